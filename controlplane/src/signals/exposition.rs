//! Reads the few vLLM gauges the picker uses out of a Prometheus text exposition
//! (<https://prometheus.io/docs/instrumenting/exposition_formats/#text-based-format>).
//!
//! Written here rather than taken from a general parser: a scrape round reads every pod
//! every 50 ms, a vLLM body is mostly histogram lines we skip by name without parsing, and
//! only four series are kept.

use super::types::{LoraReading, Reading};

const WAITING: &str = "vllm:num_requests_waiting";
const RUNNING: &str = "vllm:num_requests_running";
const KV_CACHE: &str = "vllm:kv_cache_usage_perc";
/// vLLM's name for [`KV_CACHE`] before v0.10 (still exported, deprecated, by later ones).
const KV_CACHE_OLD: &str = "vllm:gpu_cache_usage_perc";
const LORA: &str = "vllm:lora_requests_info";

/// Most adapters a reading may list as running, and as waiting. vLLM serves a handful at a
/// time (`--max-loras`); a reading travels in every signal batch of its pool's shard, so one
/// pod listing megabytes of names would push those batches past what proxies accept.
const MAX_LORA_ADAPTERS: usize = 64;
/// Longest adapter name a reading may hold, in bytes.
const MAX_LORA_NAME_BYTES: usize = 256;

/// The picker's figures from a `/metrics` body. Data-parallel servers export one series per
/// engine: queues add up, KV-cache use is the fullest engine's. For `vllm:lora_requests_info`
/// the newest series (its value is the time it was updated) counts, as in the Inference
/// Extension's LoRA scorer.
pub fn read_vllm(body: &str) -> Result<Reading, String> {
    let mut waiting = None::<f64>;
    let mut running = 0.0;
    let mut kv_cache = None::<f64>;
    let mut kv_cache_old = None::<f64>;
    // The newest series' labels; read into adapters only at the end, so a series that a
    // newer one replaces is never held against the pod.
    let mut lora: Option<(f64, Vec<(String, String)>)> = None;
    for (number, line) in body.lines().enumerate() {
        let line = line.trim_start();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let name_end = line.find(['{', ' ', '\t']).unwrap_or(line.len());
        let name = &line[..name_end];
        if ![WAITING, RUNNING, KV_CACHE, KV_CACHE_OLD, LORA].contains(&name) {
            continue;
        }
        let sample =
            parse_sample(&line[name_end..]).map_err(|problem| format!("line {}: {problem}", number + 1))?;
        let value = sample.value;
        if !value.is_finite() || value < 0.0 {
            return Err(format!("line {}: {name} is {value}", number + 1));
        }
        match name {
            WAITING => *waiting.get_or_insert(0.0) += value,
            RUNNING => running += value,
            KV_CACHE => kv_cache = Some(kv_cache.map_or(value, |held: f64| held.max(value))),
            KV_CACHE_OLD => kv_cache_old = Some(kv_cache_old.map_or(value, |held: f64| held.max(value))),
            _ => {
                if lora.as_ref().is_none_or(|(newest, _)| value >= *newest) {
                    lora = Some((value, sample.labels));
                }
            }
        }
    }
    let waiting =
        waiting.ok_or_else(|| format!("no {WAITING} in the response: not a vLLM metrics endpoint?"))?;
    let kv_cache_usage = kv_cache
        .or(kv_cache_old)
        .ok_or_else(|| format!("no {KV_CACHE} (or {KV_CACHE_OLD}) in the response"))?;
    Ok(Reading {
        age_ms: 0,
        waiting: count(waiting),
        running: count(running),
        kv_cache_usage: kv_cache_usage.min(1.0),
        lora: lora.map(|(_, labels)| lora_reading(&labels)).transpose()?,
    })
}

fn count(value: f64) -> u32 {
    // `as` saturates; gauges of request counts are whole numbers.
    value.round() as u32
}

/// Refuses the whole reading when an adapter list is beyond [`MAX_LORA_ADAPTERS`] or
/// [`MAX_LORA_NAME_BYTES`]: a truncated list would tell the picker an adapter is not loaded
/// where it is.
fn lora_reading(labels: &[(String, String)]) -> Result<LoraReading, String> {
    let label = |name: &str| {
        labels
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
            .unwrap_or_default()
    };
    let adapters = |name: &str| -> Result<Vec<String>, String> {
        let mut adapters = Vec::new();
        for adapter in label(name).split(',').map(str::trim).filter(|a| !a.is_empty()) {
            if adapters.len() == MAX_LORA_ADAPTERS {
                return Err(format!(
                    "{LORA}: {name} lists more than {MAX_LORA_ADAPTERS} adapters"
                ));
            }
            if adapter.len() > MAX_LORA_NAME_BYTES {
                return Err(format!(
                    "{LORA}: {name} has an adapter name of {} bytes (at most {MAX_LORA_NAME_BYTES})",
                    adapter.len()
                ));
            }
            adapters.push(adapter.to_string());
        }
        Ok(adapters)
    };
    Ok(LoraReading {
        max_loras: label("max_lora").parse().unwrap_or(0),
        running: adapters("running_lora_adapters")?,
        waiting: adapters("waiting_lora_adapters")?,
    })
}

struct Sample {
    labels: Vec<(String, String)>,
    value: f64,
}

/// `{name="value",...} value [timestamp]`, the part of a sample line after the metric name.
fn parse_sample(rest: &str) -> Result<Sample, String> {
    let mut labels = Vec::new();
    let mut rest = rest;
    if let Some(after_brace) = rest.strip_prefix('{') {
        rest = after_brace;
        loop {
            rest = rest.trim_start_matches([' ', ',']);
            if let Some(after) = rest.strip_prefix('}') {
                rest = after;
                break;
            }
            let (name, after_name) = rest.split_once('=').ok_or("label without '='")?;
            let after_quote = after_name.strip_prefix('"').ok_or("label value not quoted")?;
            let (value, after_value) = unquote(after_quote)?;
            labels.push((name.trim().to_string(), value));
            rest = after_value;
        }
    }
    let value = rest.split_whitespace().next().ok_or("sample without a value")?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().map_err(|_| format!("{other:?} is not a number"))?,
    };
    Ok(Sample { labels, value })
}

/// A label value up to its closing quote, with `\\`, `\"` and `\n` unescaped; the rest after
/// the quote.
fn unquote(text: &str) -> Result<(String, &str), String> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((at, c)) = chars.next() {
        match c {
            '"' => return Ok((value, &text[at + 1..])),
            '\\' => match chars.next() {
                Some((_, 'n')) => value.push('\n'),
                Some((_, escaped)) => value.push(escaped),
                None => break,
            },
            other => value.push(other),
        }
    }
    Err("unterminated label value".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-32B"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-32B"} 4.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-32B"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-32B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-32B"} 0.5
vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-32B"} 0.9
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="Qwen/Qwen3-32B"} 12
vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql-lora",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a, b",waiting_lora_adapters="c"} 1.8e9
"#;

    #[test]
    fn reads_vllm_gauges_across_engines() {
        let reading = read_vllm(VLLM).unwrap();
        assert_eq!(
            reading,
            Reading {
                age_ms: 0,
                waiting: 5,
                running: 5,
                kv_cache_usage: 0.5,
                lora: Some(LoraReading {
                    max_loras: 2,
                    running: vec!["a".into(), "b".into()],
                    waiting: vec!["c".into()],
                }),
            }
        );
    }

    #[test]
    fn falls_back_to_the_old_kv_cache_name() {
        let old = "vllm:num_requests_waiting 0\nvllm:gpu_cache_usage_perc{engine=\"0\"} 0.75 1700000000000\n";
        let reading = read_vllm(old).unwrap();
        assert_eq!(
            (reading.kv_cache_usage, reading.running, reading.lora),
            (0.75, 0, None)
        );
    }

    #[test]
    fn quoted_label_values_may_hold_braces_spaces_and_escapes() {
        let body = "vllm:num_requests_waiting{model_name=\"a} \\\"b\\\"\"} 2\nvllm:kv_cache_usage_perc 0\n";
        assert_eq!(read_vllm(body).unwrap().waiting, 2);
    }

    #[test]
    fn refuses_what_is_not_a_vllm_metrics_body() {
        for (body, expected) in [
            ("<html>hello</html>", "no vllm:num_requests_waiting"),
            ("vllm:num_requests_waiting 1\n", "no vllm:kv_cache_usage_perc"),
            (
                "vllm:num_requests_waiting{a=\"x} 1\nvllm:kv_cache_usage_perc 0",
                "unterminated",
            ),
            ("vllm:num_requests_waiting{a=x} 1", "not quoted"),
            (
                "vllm:num_requests_waiting NaN\nvllm:kv_cache_usage_perc 0",
                "is NaN",
            ),
            (
                "vllm:num_requests_waiting -1\nvllm:kv_cache_usage_perc 0",
                "is -1",
            ),
            (
                "vllm:num_requests_waiting\nvllm:kv_cache_usage_perc 0",
                "without a value",
            ),
            ("vllm:num_requests_waiting many\n", "not a number"),
        ] {
            let error = read_vllm(body).unwrap_err();
            assert!(error.contains(expected), "{body:?}: {error}");
        }
    }

    fn with_lora(running: &str, waiting: &str) -> String {
        format!(
            "vllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n\
             vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"{waiting}\"}} 1.7e9\n"
        )
    }

    #[test]
    fn refuses_adapter_lists_too_long_for_the_signal_stream() {
        let most: Vec<String> = (0..MAX_LORA_ADAPTERS).map(|n| format!("a{n}")).collect();
        let longest = "n".repeat(MAX_LORA_NAME_BYTES);
        let lora = read_vllm(&with_lora(&most.join(","), &longest))
            .unwrap()
            .lora
            .unwrap();
        assert_eq!(
            (lora.running, lora.waiting),
            (most.clone(), vec![longest.clone()])
        );

        // A pod repeating one name over the 4 MiB a /metrics body may have.
        let flood = vec!["a"; 2 * 1024 * 1024].join(",");
        for (body, expected) in [
            (
                with_lora(&flood, ""),
                "running_lora_adapters lists more than 64 adapters",
            ),
            (
                with_lora("", &format!("{},x", most.join(","))),
                "waiting_lora_adapters lists more than 64 adapters",
            ),
            (
                with_lora(&format!("{longest}n"), ""),
                "running_lora_adapters has an adapter name of 257 bytes (at most 256)",
            ),
        ] {
            let error = read_vllm(&body).unwrap_err();
            assert!(error.contains(expected), "{error}");
        }
    }

    #[test]
    fn only_the_newest_adapter_series_is_held_to_the_limits() {
        let flood = vec!["a"; 100].join(",");
        let body = format!(
            "{}vllm:lora_requests_info{{max_lora=\"2\",running_lora_adapters=\"b\",waiting_lora_adapters=\"\"}} 1.8e9\n",
            with_lora(&flood, "")
        );
        assert_eq!(read_vllm(&body).unwrap().lora.unwrap().running, ["b"]);
    }
}
