use super::*;

const MS: Duration = Duration::from_millis(1);

fn picker(n: usize, config: PickerConfig) -> Picker {
    Picker::new(config, vec![EndpointInfo::default(); n])
}

fn signals(at: Duration, waiting: u32, kv: f64) -> Signals {
    Signals {
        sampled_at: at,
        waiting,
        running: 0,
        kv_cache_usage: kv,
        lora: None,
    }
}

fn request(prompt: &[u8]) -> PickRequest<'_> {
    PickRequest {
        model: "m",
        lora: false,
        prompt,
        priority: 0,
    }
}

fn all(_: usize) -> bool {
    true
}

#[test]
fn a_shared_prefix_follows_the_endpoint_that_got_it() {
    let mut p = picker(4, PickerConfig::default());
    let system = vec![b's'; 6000];
    let first = p.pick(MS, &request(&system), all).unwrap();
    assert_eq!(first.prefix_blocks.0, 0);
    let chosen = first.endpoints[0];
    for e in 0..4 {
        p.observe(e, signals(2 * MS, 0, 0.1));
    }
    let mut longer = system.clone();
    longer.extend_from_slice(b" and a private question");
    let second = p.pick(3 * MS, &request(&longer), all).unwrap();
    assert_eq!(second.endpoints[0], chosen);
    assert_eq!(second.basis, Basis::Signals);
    assert_eq!(
        second.prefix_blocks,
        (23, 24),
        "6000 bytes are 23 full blocks of 256; the partial 24th differs once extended"
    );
}

#[test]
fn requests_sent_since_the_last_signal_count_as_queued() {
    let mut p = picker(
        3,
        PickerConfig {
            weights: Weights {
                prefix: 0.0,
                ..Weights::default()
            },
            ..PickerConfig::default()
        },
    );
    for e in 0..3 {
        p.observe(e, signals(Duration::ZERO, 0, 0.0));
    }
    // A burst between two samples: signals alone would send all of it to one endpoint.
    let mut per_endpoint = [0; 3];
    for i in 0..9u8 {
        let pick = p.pick(MS, &request(&[i]), all).unwrap();
        per_endpoint[pick.endpoints[0]] += 1;
    }
    assert_eq!(per_endpoint, [3, 3, 3]);
    // A sample taken after the burst already counts it: the own counts reset.
    for e in 0..3 {
        p.observe(e, signals(2 * MS, if e == 0 { 4 } else { 0 }, 0.0));
    }
    let pick = p.pick(3 * MS, &request(b"x"), all).unwrap();
    assert_ne!(pick.endpoints[0], 0, "endpoint 0 reports the longest queue");
}

#[test]
fn a_long_queue_outweighs_a_cached_prefix_only_past_the_saturation_line() {
    let mut p = picker(2, PickerConfig::default());
    let prompt = vec![b'p'; 2000];
    let chosen = p.pick(MS, &request(&prompt), all).unwrap().endpoints[0];
    let other = 1 - chosen;
    // Below saturation (4 waiting < 5), the prefix wins.
    p.observe(chosen, signals(2 * MS, 4, 0.3));
    p.observe(other, signals(2 * MS, 0, 0.3));
    let pick = p.pick(3 * MS, &request(&prompt), all).unwrap();
    assert_eq!(pick.endpoints, vec![chosen, other]);
    // Saturated (KV over 0.8): filtered out while another endpoint has room.
    p.observe(chosen, signals(4 * MS, 0, 0.9));
    p.observe(other, signals(4 * MS, 0, 0.3));
    let pick = p.pick(5 * MS, &request(&prompt), all).unwrap();
    assert_eq!(pick.endpoints, vec![other]);
    assert!(!pick.saturated);
}

#[test]
fn stale_signals_fall_back_to_own_counts_or_refuse() {
    let mut open = picker(2, PickerConfig::default());
    open.observe(0, signals(Duration::ZERO, 0, 0.0));
    open.observe(1, signals(Duration::ZERO, 0, 0.0));
    let late = Duration::from_secs(1);
    let first = open.pick(late, &request(b"a"), all).unwrap();
    assert_eq!(first.basis, Basis::OwnCounts);
    let second = open.pick(late, &request(b"b"), all).unwrap();
    assert_ne!(
        first.endpoints[0], second.endpoints[0],
        "in-flight counts spread the load"
    );
    open.finished(first.endpoints[0]);
    open.finished(second.endpoints[0]);
    assert_eq!(open.in_flight(0) + open.in_flight(1), 0);

    let mut closed = picker(
        2,
        PickerConfig {
            failure_mode: FailureMode::FailClose,
            ..PickerConfig::default()
        },
    );
    assert_eq!(
        closed.pick(late, &request(b"a"), all),
        Err(Refusal::SignalsUnavailable)
    );
    closed.observe(1, signals(late, 0, 0.0));
    let pick = closed.pick(late, &request(b"a"), all).unwrap();
    assert_eq!(
        pick.endpoints,
        vec![1],
        "only endpoints with fresh signals are candidates"
    );
}

#[test]
fn a_saturated_pool_sheds_low_priority_requests_only() {
    let mut p = picker(2, PickerConfig::default());
    p.observe(0, signals(Duration::ZERO, 9, 0.5));
    p.observe(1, signals(Duration::ZERO, 1, 0.95));
    let sheddable = PickRequest {
        priority: -1,
        ..request(b"x")
    };
    assert_eq!(
        p.pick(MS, &sheddable, all),
        Err(Refusal::Saturated {
            retry_after: Duration::from_secs(1)
        })
    );
    let pick = p.pick(MS, &request(b"x"), all).unwrap();
    assert!(pick.saturated, "nothing had room, so nothing was filtered out");
    assert_eq!(pick.endpoints.len(), 2);
}

#[test]
fn fallbacks_are_distinct_and_bounded() {
    let mut p = picker(10, PickerConfig::default());
    for e in 0..10 {
        p.observe(e, signals(Duration::ZERO, e as u32 % 4, 0.1));
    }
    let pick = p.pick(MS, &request(b"q"), all).unwrap();
    assert_eq!(pick.endpoints.len(), 3);
    let mut distinct = pick.endpoints.clone();
    distinct.dedup();
    assert_eq!(distinct.len(), 3);
    assert!(
        pick.endpoints.iter().all(|e| e % 4 == 0),
        "the emptiest queues: {pick:?}"
    );
}

#[test]
fn unhealthy_and_ineligible_endpoints_are_skipped() {
    let mut p = Picker::new(
        PickerConfig::default(),
        vec![
            EndpointInfo::default(),
            EndpointInfo {
                models: vec!["other".into()],
            },
            EndpointInfo::default(),
        ],
    );
    for _ in 0..10 {
        let pick = p.pick(MS, &request(b"q"), |e| e != 0).unwrap();
        assert_eq!(pick.endpoints, vec![2]);
    }
    let pick = p.pick(MS, &request(b"q"), |_| false).unwrap();
    assert_eq!(pick.endpoints.len(), 2, "all suspect: try them anyway");
    let other = PickRequest {
        model: "other",
        ..request(b"q")
    };
    assert_eq!(p.pick(MS, &other, |e| e == 1).unwrap().endpoints[0], 1);
    let unknown = PickRequest {
        model: "nobody",
        ..request(b"q")
    };
    let mut only = Picker::new(
        PickerConfig::default(),
        vec![EndpointInfo {
            models: vec!["m".into()],
        }],
    );
    assert_eq!(only.pick(MS, &unknown, all), Err(Refusal::NoEndpoint));
}

#[test]
fn lora_affinity_prefers_a_loaded_adapter() {
    let mut p = picker(3, PickerConfig::default());
    let lora = |running: &[&str], max_loras| LoraSignals {
        running: running.iter().map(|s| s.to_string()).collect(),
        waiting: vec![],
        max_loras,
    };
    for (e, state) in [lora(&["a", "b"], 2), lora(&["b", "c"], 2), lora(&["c"], 2)]
        .into_iter()
        .enumerate()
    {
        p.observe(
            e,
            Signals {
                lora: Some(state),
                ..signals(Duration::ZERO, 0, 0.2)
            },
        );
    }
    let pick = |p: &mut Picker, adapter| {
        p.pick(
            MS,
            &PickRequest {
                model: adapter,
                lora: true,
                ..request(b"q")
            },
            all,
        )
        .unwrap()
        .endpoints
    };
    assert_eq!(pick(&mut p, "a")[0], 0, "loaded");
    assert_eq!(pick(&mut p, "z")[0], 2, "the only endpoint with room to load it");
}

#[test]
fn plain_strategies_stay_selectable() {
    let mut rr = picker(
        3,
        PickerConfig {
            strategy: Strategy::RoundRobin,
            ..PickerConfig::default()
        },
    );
    let firsts: Vec<usize> = (0..4)
        .map(|_| rr.pick(MS, &request(b"q"), all).unwrap().endpoints[0])
        .collect();
    assert_eq!(firsts, vec![0, 1, 2, 0]);

    let mut least = picker(
        2,
        PickerConfig {
            strategy: Strategy::LeastRequest,
            ..PickerConfig::default()
        },
    );
    let a = least.pick(MS, &request(b"q"), all).unwrap().endpoints[0];
    let b = least.pick(MS, &request(b"q"), all).unwrap().endpoints[0];
    assert_ne!(a, b);
    least.finished(a);
    let pick = least.pick(MS, &request(b"q"), all).unwrap();
    assert_eq!(pick.endpoints[0], a);
    assert_eq!(pick.basis, Basis::LeastRequest);
}
