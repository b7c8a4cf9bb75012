use super::*;

const MS: Duration = Duration::from_millis(1);

fn picker(n: usize, config: PickerConfig) -> Picker {
    Picker::new(config, n)
}

fn signals(at: Duration, waiting: u32, kv: f64) -> Signals {
    Signals {
        sampled_at: at,
        waiting,
        kv_cache_usage: kv,
        lora: None,
    }
}

fn hashes(prompt: &[u8]) -> Vec<u64> {
    block_hashes("m", prompt, &PrefixConfig::default())
}

fn pick(p: &mut Picker, now: Duration, prompt: &[u8]) -> Result<Pick, Refusal> {
    let hashes = hashes(prompt);
    p.pick(
        now,
        &PickRequest {
            model: "m",
            lora: false,
            prompt_hashes: &hashes,
        },
        |_| true,
    )
}

#[test]
fn a_shared_prefix_follows_the_endpoint_that_got_it() {
    let mut p = picker(4, PickerConfig::default());
    let system = vec![b's'; 6000];
    let first = pick(&mut p, MS, &system).unwrap();
    assert_eq!(first.prefix_hit_blocks, 0);
    let chosen = first.endpoints[0];
    for e in 0..4 {
        p.observe(e, signals(2 * MS, 0, 0.1));
    }
    let mut longer = system.clone();
    longer.extend_from_slice(b" and a private question");
    let second = pick(&mut p, 3 * MS, &longer).unwrap();
    assert_eq!(second.endpoints[0], chosen);
    assert_eq!(second.basis, Basis::Signals);
    assert_eq!(
        second.prefix_hit_blocks, 23,
        "6000 bytes are 23 full blocks of 256; the partial 24th differs once extended"
    );
}

#[test]
fn a_prefix_another_proxy_placed_is_followed() {
    let system = vec![b's'; 6000];
    // Over many prompts, a proxy that learns nothing lands where the other placed only by
    // chance (1 in 4); one that learns lands there every time.
    let mut followed = [0, 0];
    for (learns, followed) in [false, true].into_iter().zip(&mut followed) {
        for family in 0..20u8 {
            let system: Vec<u8> = system.iter().map(|b| b ^ family).collect();
            let mut longer = system.clone();
            longer.extend_from_slice(b" and a private question");
            let mut placed_by = picker(
                4,
                PickerConfig {
                    seed: u64::from(family),
                    ..PickerConfig::default()
                },
            );
            let mut other = picker(
                4,
                PickerConfig {
                    seed: 100 + u64::from(family),
                    ..PickerConfig::default()
                },
            );
            let placed = pick(&mut placed_by, MS, &system).unwrap().endpoints[0];
            if learns {
                other.learn(placed, &hashes(&system));
            }
            for e in 0..4 {
                other.observe(e, signals(2 * MS, 0, 0.1));
            }
            let chosen = pick(&mut other, 3 * MS, &longer).unwrap();
            if chosen.endpoints[0] == placed {
                *followed += 1;
                if learns {
                    assert_eq!(chosen.prefix_hit_blocks, 23);
                }
            }
        }
    }
    assert_eq!(followed[1], 20);
    assert!(
        followed[0] < 15,
        "without learning, {} of 20 followed",
        followed[0]
    );
    // A placement withdrawn is forgotten.
    let mut p = picker(4, PickerConfig::default());
    p.learn(2, &hashes(&system));
    p.forget(2, &hashes(&system));
    assert_eq!(pick(&mut p, MS, &system).unwrap().prefix_hit_blocks, 0);
    // An endpoint the picker does not have is ignored.
    let mut p = picker(2, PickerConfig::default());
    p.learn(7, &hashes(&system));
    p.forget(7, &hashes(&system));
    assert_eq!(pick(&mut p, MS, &system).unwrap().prefix_hit_blocks, 0);
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
        let chosen = pick(&mut p, MS, &[i]).unwrap().endpoints[0];
        per_endpoint[chosen] += 1;
    }
    assert_eq!(per_endpoint, [3, 3, 3]);
    // A sample taken after the burst already counts it: the own counts reset.
    for e in 0..3 {
        p.observe(e, signals(2 * MS, if e == 0 { 4 } else { 0 }, 0.0));
    }
    let chosen = pick(&mut p, 3 * MS, b"x").unwrap().endpoints[0];
    assert_ne!(chosen, 0, "endpoint 0 reports the longest queue");
}

#[test]
fn a_cached_prefix_outweighs_a_queue_until_the_endpoint_is_saturated() {
    let mut p = picker(2, PickerConfig::default());
    let prompt = vec![b'p'; 2000];
    let chosen = pick(&mut p, MS, &prompt).unwrap().endpoints[0];
    let other = 1 - chosen;
    // Below saturation (4 waiting < 5), the prefix wins.
    p.observe(chosen, signals(2 * MS, 4, 0.3));
    p.observe(other, signals(2 * MS, 0, 0.3));
    let second = pick(&mut p, 3 * MS, &prompt).unwrap();
    assert_eq!(second.endpoints, vec![chosen, other]);
    // Saturated (KV over 0.8): ranked after the endpoint with room, prefix or not, but kept
    // as its fallback: if the one with room refuses, a busy pod beats answering 503.
    p.observe(chosen, signals(4 * MS, 0, 0.9));
    p.observe(other, signals(4 * MS, 0, 0.3));
    let third = pick(&mut p, 5 * MS, &prompt).unwrap();
    assert_eq!(third.endpoints, vec![other, chosen]);
    assert!(!third.saturated);
    // Everyone saturated: nothing is set aside, and the pick says so.
    p.observe(other, signals(6 * MS, 9, 0.3));
    let fourth = pick(&mut p, 7 * MS, &prompt).unwrap();
    assert!(fourth.saturated);
    assert_eq!(fourth.endpoints.len(), 2);
}

#[test]
fn stale_signals_fall_back_to_own_counts_or_refuse() {
    let mut open = picker(2, PickerConfig::default());
    open.observe(0, signals(Duration::ZERO, 0, 0.0));
    open.observe(1, signals(Duration::ZERO, 0, 0.0));
    let late = Duration::from_secs(1);
    let first = pick(&mut open, late, b"a").unwrap();
    assert_eq!(first.basis, Basis::OwnCounts);
    let second = pick(&mut open, late, b"b").unwrap();
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
    assert_eq!(pick(&mut closed, late, b"a"), Err(Refusal::SignalsUnavailable));
    closed.observe(1, signals(late, 0, 0.0));
    assert_eq!(pick(&mut closed, late, b"a").unwrap().basis, Basis::Signals);
}

#[test]
fn an_endpoint_with_stale_signals_is_only_a_fallback_while_others_report() {
    let mut p = picker(3, PickerConfig::default());
    // Endpoints 0 and 1 report; endpoint 2 never has. While a fresh endpoint has room, the
    // silent one is only the last resort (a late scrape is often an overloaded pod).
    p.observe(0, signals(Duration::ZERO, 1, 0.2));
    p.observe(1, signals(Duration::ZERO, 2, 0.2));
    let chosen = pick(&mut p, MS, b"a").unwrap();
    assert_eq!(chosen.basis, Basis::Signals);
    assert_eq!(chosen.endpoints, vec![0, 1, 2]);
    // Everyone with signals saturated: nothing is set aside, the silent one included, and
    // it is judged on this proxy's own counts.
    p.observe(0, signals(2 * MS, 9, 0.2));
    p.observe(1, signals(2 * MS, 9, 0.2));
    let chosen = pick(&mut p, 3 * MS, b"b").unwrap();
    assert!(chosen.saturated);
    assert_eq!(chosen.endpoints.len(), 3);
}

#[test]
fn a_stale_endpoint_never_beats_saturated_fresh_ones_on_its_own_counts() {
    let mut p = picker(3, PickerConfig::default());
    // Every pod reports a queue over the threshold; endpoint 2 stopped reporting. Its own
    // count (nothing in flight from this proxy) says nothing about the queue other proxies
    // put there, so it must not look like the emptiest pod.
    p.observe(0, signals(Duration::ZERO, 9, 0.2));
    p.observe(1, signals(Duration::ZERO, 9, 0.2));
    for at in 1..=5 {
        let chosen = pick(&mut p, at * MS, b"q").unwrap();
        assert!(chosen.saturated);
        assert_eq!(chosen.endpoints.len(), 3);
        assert_ne!(chosen.endpoints[0], 2, "pick {at}: {chosen:?}");
        assert_eq!(chosen.endpoints[2], 2, "pick {at}: {chosen:?}");
    }
}

#[test]
fn fallbacks_are_distinct_and_bounded() {
    let mut p = picker(10, PickerConfig::default());
    for e in 0..10 {
        p.observe(e, signals(Duration::ZERO, e as u32 % 4, 0.1));
    }
    let chosen = pick(&mut p, MS, b"q").unwrap();
    assert_eq!(chosen.endpoints.len(), 3);
    let mut distinct = chosen.endpoints.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 3);
    assert!(
        chosen.endpoints.iter().all(|e| e % 4 == 0),
        "the emptiest queues: {chosen:?}"
    );
}

#[test]
fn unhealthy_endpoints_are_skipped_unless_all_are() {
    let mut p = picker(3, PickerConfig::default());
    let hashes = hashes(b"q");
    let request = PickRequest {
        model: "m",
        lora: false,
        prompt_hashes: &hashes,
    };
    for _ in 0..10 {
        let chosen = p.pick(MS, &request, |e| e == 2).unwrap();
        assert_eq!(chosen.endpoints, vec![2]);
    }
    let all_suspect = p.pick(MS, &request, |_| false).unwrap();
    assert_eq!(all_suspect.endpoints.len(), 3, "all suspect: try them anyway");
    assert_eq!(
        picker(0, PickerConfig::default()).pick(MS, &request, |_| true),
        Err(Refusal::NoEndpoint)
    );
}

#[test]
fn a_fallback_takes_over_the_in_flight_count_and_the_prefix() {
    let mut p = picker(2, PickerConfig::default());
    let prompt = vec![b'z'; 3000];
    let first = pick(&mut p, MS, &prompt).unwrap();
    let (refused, used) = (first.endpoints[0], first.endpoints[1]);
    p.moved(refused, used, MS, &hashes(&prompt));
    assert_eq!((p.in_flight(refused), p.in_flight(used)), (0, 1));
    p.finished(used);
    let hashes = hashes(&prompt);
    let request = PickRequest {
        model: "m",
        lora: false,
        prompt_hashes: &hashes,
    };
    let on_refused = p.pick(2 * MS, &request, |e| e == refused).unwrap();
    assert_eq!(
        on_refused.prefix_hit_blocks, 0,
        "the refusing endpoint lost its credit"
    );
    p.finished(refused);
    let on_used = p.pick(2 * MS, &request, |e| e == used).unwrap();
    assert_eq!(on_used.prefix_hit_blocks, 12, "the prefix followed the request");
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
    let mut pick_adapter = |adapter| {
        // Prefix hashes are seeded by the model: adapters never share cache entries.
        let hashes = block_hashes(adapter, b"q", &PrefixConfig::default());
        p.pick(
            MS,
            &PickRequest {
                model: adapter,
                lora: true,
                prompt_hashes: &hashes,
            },
            |_| true,
        )
        .unwrap()
        .endpoints[0]
    };
    assert_eq!(pick_adapter("a"), 0, "loaded");
    assert_eq!(pick_adapter("z"), 2, "the only endpoint with room to load it");
}

#[test]
fn nonsense_numbers_neither_panic_nor_poison_the_order() {
    let mut p = picker(
        2,
        PickerConfig {
            queue_threshold: 0.0,
            kv_cache_threshold: f64::NAN,
            ..PickerConfig::default()
        },
    );
    // Thresholds fall back to their defaults (5 waiting, 0.8 KV): endpoint 1 (3 waiting,
    // 0.5) has room, endpoint 0 (0.9) has not and ranks after it despite its empty queue.
    // Unsanitized, both would count as saturated and endpoint 0 would win on its queue.
    p.observe(0, signals(Duration::ZERO, 0, 0.9));
    p.observe(1, signals(Duration::ZERO, 3, 0.5));
    assert_eq!(pick(&mut p, MS, b"q").unwrap().endpoints, vec![1, 0]);
    // A NaN sample is dropped; one above 1 is clamped to 1 (saturated).
    p.observe(1, signals(2 * MS, 0, f64::NAN));
    p.observe(0, signals(2 * MS, 0, 7.0));
    let chosen = pick(&mut p, 3 * MS, b"q").unwrap();
    assert_eq!(
        chosen.endpoints,
        vec![1, 0],
        "endpoint 1's earlier sample still stands"
    );
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
        .map(|_| pick(&mut rr, MS, b"q").unwrap().endpoints[0])
        .collect();
    assert_eq!(firsts, vec![0, 1, 2, 0]);

    let mut least = picker(
        2,
        PickerConfig {
            strategy: Strategy::LeastRequest,
            ..PickerConfig::default()
        },
    );
    let a = pick(&mut least, MS, b"q").unwrap().endpoints[0];
    let b = pick(&mut least, MS, b"q").unwrap().endpoints[0];
    assert_ne!(a, b);
    least.finished(a);
    let chosen = pick(&mut least, MS, b"q").unwrap();
    assert_eq!(chosen.endpoints[0], a);
    assert_eq!(chosen.basis, Basis::LeastRequest);
}

#[test]
fn saturation_is_judged_without_crediting_anyone() {
    let mut picker = Picker::new(PickerConfig::default(), 2);
    let now = Duration::from_secs(1);
    let busy = |waiting| Signals {
        sampled_at: now,
        waiting,
        kv_cache_usage: 0.1,
        lora: None,
    };
    picker.observe(0, busy(5));
    picker.observe(1, busy(4));
    assert!(
        !picker.saturated(now, |_| true),
        "endpoint 1 has room (4 < 5 waiting)"
    );
    assert_eq!(picker.in_flight(1), 0, "asking credits nobody");
    // Ejecting the one with room leaves only saturated candidates.
    assert!(picker.saturated(now, |e| e == 0));
    picker.observe(1, busy(5));
    assert!(picker.saturated(now, |_| true));
    let plain = PickerConfig {
        strategy: Strategy::RoundRobin,
        ..PickerConfig::default()
    };
    let mut plain = Picker::new(plain, 1);
    plain.observe(0, busy(50));
    assert!(!plain.saturated(now, |_| true), "only Scored detects saturation");
}

#[test]
fn requests_that_finished_since_the_last_signal_do_not_count_as_waiting() {
    let config = PickerConfig {
        queue_threshold: 3.0,
        ..PickerConfig::default()
    };
    let mut picker = Picker::new(config, 2);
    let now = Duration::from_secs(1);
    for endpoint in 0..2 {
        picker.observe(
            endpoint,
            Signals {
                sampled_at: now,
                waiting: 0,
                kv_cache_usage: 0.0,
                lora: None,
            },
        );
    }
    // Five short requests to endpoint 0 start and finish before the next signal.
    let request = PickRequest {
        model: "m",
        lora: false,
        prompt_hashes: &[],
    };
    for _ in 0..5 {
        let pick = picker.pick(now, &request, |e| e == 0).unwrap();
        assert_eq!(pick.endpoints[0], 0);
        picker.finished(0);
    }
    assert!(
        !picker.saturated(now, |e| e == 0),
        "five finished requests are not a queue of five"
    );
    // Three still in flight are.
    for _ in 0..3 {
        picker.pick(now, &request, |e| e == 0).unwrap();
    }
    assert!(picker.saturated(now, |e| e == 0));
}

#[test]
fn an_edited_pool_keeps_what_it_knew_about_the_endpoints_it_kept() {
    let config = PickerConfig {
        failure_mode: FailureMode::FailClose,
        ..PickerConfig::default()
    };
    let mut old = picker(3, config.clone());
    for (e, waiting) in [3, 0, 3].into_iter().enumerate() {
        old.observe(e, signals(MS, waiting, 0.1));
    }
    let prompt = vec![b'p'; 3000];
    assert_eq!(pick(&mut old, 2 * MS, &prompt).unwrap().endpoints[0], 1);

    // The edit drops endpoint 0, swaps the places of 1 and 2 and adds one; the new picker's
    // clock reads 10 ms more for the same moment.
    let map = [Some(2), None, Some(1)];
    let offset = 10 * MS;
    let mut new = picker(3, config);
    new.inherit(&old, &map, offset);

    for (to, from) in map.iter().enumerate() {
        let Some(from) = *from else {
            assert_eq!(
                (new.signals(to), new.in_flight(to)),
                (None, 0),
                "a new endpoint starts blank"
            );
            continue;
        };
        let expected = old.signals(from).map(|s| Signals {
            sampled_at: s.sampled_at + offset,
            ..s.clone()
        });
        assert_eq!(new.signals(to), expected.as_ref());
        assert_eq!(new.in_flight(to), old.in_flight(from));
    }
    assert_eq!(new.in_flight(2), 1, "the request in flight is still counted");

    // Fresh on the new clock: a pool that fails closed picks instead of refusing, and the
    // prompt goes where its prefix was placed.
    let hashes = hashes(&prompt);
    let request = PickRequest {
        model: "m",
        lora: false,
        prompt_hashes: &hashes,
    };
    let again = new.pick(offset + 3 * MS, &request, |_| true).unwrap();
    assert_eq!(again.basis, Basis::Signals);
    assert_eq!(again.endpoints[0], 2);
    assert_eq!(again.prefix_hit_blocks, 12);
}
