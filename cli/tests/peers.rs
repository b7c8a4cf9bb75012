//! Peers nobody here wrote, against Portcullis' test servers, straight and through the
//! proxy: the official `openai` Python client streaming from the vLLM simulator, the
//! official `mcp` Python client (both protocol eras) calling the MCP test server, and
//! `portcullis loadtest` comparing the direct path with the gateway.
//!
//! The Python peers live in the virtualenv that `./scripts/test` creates (`.venv`, or
//! `$PORTCULLIS_VENV`).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::*;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn python() -> PathBuf {
    let venv = std::env::var_os("PORTCULLIS_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".venv"));
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "{} is missing: run ./scripts/test, which creates the peers' virtualenv",
        python.display()
    );
    python
}

/// Runs a peer script; panics with its output unless it exits 0.
fn peer(script: &str, args: &[&str]) -> String {
    let output = Command::new(python())
        .arg(repo_root().join("loadtest/peers").join(script))
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "{script} {args:?} failed:\n{text}");
    text
}

/// A control plane and a proxy routing every request on a fresh listener to `upstream`.
struct Gateway {
    _controlplane: Process,
    _proxy: Process,
    port: u16,
}

fn gateway(dir: &Path, upstream: u16) -> Gateway {
    let (cp_port, admin, port) = (free_port(), free_port(), free_port());
    let cp = format!("127.0.0.1:{cp_port}");
    let data = dir.join("cp");
    let controlplane = Process::start(
        "controlplane",
        dir,
        &[
            "controlplane",
            "--listen",
            &cp,
            "--data-dir",
            data.to_str().unwrap(),
        ],
    );
    wait_for("control plane", TIMEOUT, || {
        cli(&["status", "--controlplane", &cp]).status.success()
    });
    let proxy = Process::start(
        "proxy",
        dir,
        &[
            "proxy",
            "--id",
            "gw",
            "--controlplane",
            &cp,
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ],
    );
    let config = format!(
        "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: upstream}}\nspec: {{endpoints: ['127.0.0.1:{upstream}']}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: all}}\nspec: {{listeners: [gw], backends: [{{name: upstream}}], timeout: 60s}}\n"
    );
    let file = write_file(dir, "gateway.yaml", &config);
    let applied = cli(&["apply", "-f", file.to_str().unwrap(), "--controlplane", &cp]);
    assert!(applied.status.success(), "{}", stderr(&applied));
    wait_for("gateway ready", TIMEOUT, || {
        http_get(admin, "/readyz").is_some_and(|r| r.status == 200)
    });
    Gateway {
        _controlplane: controlplane,
        _proxy: proxy,
        port,
    }
}

#[test]
fn openai_client_streams_from_the_simulator_direct_and_through_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _sim = Process::start(
        "sim",
        dir.path(),
        &[
            "sim",
            "vllm",
            "--pods",
            "1",
            "--port",
            &pod.to_string(),
            "--time-scale",
            "10",
        ],
    );
    wait_for("simulator", TIMEOUT, || {
        http_get(pod, "/health").is_some_and(|r| r.status == 200)
    });
    let direct = peer("openai_stream.py", &[&format!("http://127.0.0.1:{pod}")]);
    assert!(direct.starts_with("OK"), "{direct}");
    let gateway = gateway(dir.path(), pod);
    let through = peer(
        "openai_stream.py",
        &[&format!("http://127.0.0.1:{}", gateway.port)],
    );
    assert!(through.starts_with("OK"), "{through}");
}

#[test]
fn mcp_python_client_calls_the_test_server_in_both_eras_direct_and_through_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = Process::start(
        "mcp",
        dir.path(),
        &[
            "mcp-server",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--tools",
            "8",
        ],
    );
    wait_for("MCP server", TIMEOUT, || {
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    let gateway = gateway(dir.path(), port);
    for target in [port, gateway.port] {
        let url = format!("http://127.0.0.1:{target}/mcp");
        for mode in ["legacy", "2026-07-28", "auto"] {
            let output = peer("mcp_client.py", &[&url, mode, "10"]);
            assert!(output.contains("OK"), "{mode} via {url}: {output}");
        }
    }
}

#[test]
fn loadtest_compares_the_direct_path_with_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _sim = Process::start(
        "sim",
        dir.path(),
        &[
            "sim",
            "vllm",
            "--pods",
            "1",
            "--port",
            &pod.to_string(),
            "--time-scale",
            "20",
        ],
    );
    wait_for("simulator", TIMEOUT, || {
        http_get(pod, "/health").is_some_and(|r| r.status == 200)
    });
    let gateway = gateway(dir.path(), pod);
    let scenario = format!(
        "api: {{type: chat, streaming: true}}\nmodel: Qwen/Qwen3-32B\ntargets:\n  - {{name: direct, url: 'http://127.0.0.1:{pod}'}}\n  - {{name: gateway, url: 'http://127.0.0.1:{}'}}\n\
         data: {{type: shared_prefix, num_groups: 2, num_prompts_per_group: 2, system_prompt_len: 256, question_len: 32, output_len: 16}}\n\
         load: {{type: poisson, stages: [{{rate: 4, duration: 2s}}, {{rate: 8, duration: 2s}}], seed: 7}}\nrequest_timeout: 60s\n",
        gateway.port
    );
    let file = write_file(dir.path(), "scenario.yaml", &scenario);
    let out = dir.path().join("results");
    let run = cli(&[
        "loadtest",
        "-f",
        file.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--no-progress",
    ]);
    assert!(run.status.success(), "{}{}", stdout(&run), stderr(&run));
    let csv = std::fs::read_to_string(out.join("report.csv")).unwrap();
    let rows: Vec<&str> = csv.lines().skip(1).collect();
    assert_eq!(rows.len(), 4, "2 targets x 2 stages:\n{csv}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    let text = report.to_string();
    assert!(
        text.contains("\"gateway\"") && text.contains("\"direct\""),
        "{text}"
    );
    for plot in ["ttft_p50_vs_rate.svg", "output_throughput_vs_rate.svg"] {
        assert!(
            std::fs::metadata(out.join(plot)).unwrap().len() > 0,
            "{plot} empty"
        );
    }
    // Columns: target, stage, requested_rate, achieved_rate, duration_s, requests, successes, failures, …
    for row in rows {
        let cells: Vec<&str> = row.split(',').collect();
        let (successes, failures): (u64, u64) = (cells[6].parse().unwrap(), cells[7].parse().unwrap());
        assert!(successes > 0 && failures == 0, "{row}");
    }
}

/// Sum of every series of one metric on a simulated pod's `/metrics`.
fn metric(port: u16, name: &str) -> f64 {
    let body = http_get(port, "/metrics").unwrap().body;
    body.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn inference_perf_runs_against_the_simulator_and_agrees_with_its_counters() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _sim = Process::start(
        "sim",
        dir.path(),
        &["sim", "vllm", "--pods", "1", "--port", &pod.to_string()],
    );
    wait_for("simulator", TIMEOUT, || {
        http_get(pod, "/health").is_some_and(|r| r.status == 200)
    });
    let out = dir.path().join("inference-perf");
    std::fs::create_dir_all(&out).unwrap();
    let venv = python().parent().unwrap().parent().unwrap().to_path_buf();
    let run = Command::new("bash")
        .arg(repo_root().join("loadtest/peers/inference_perf/run.sh"))
        .arg(format!("http://127.0.0.1:{pod}"))
        .arg(&out)
        .env("PORTCULLIS_VENV", &venv)
        .env("IP_DURATION", "5")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(run.status.success(), "inference-perf failed:\n{text}");

    let summary: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("reports/summary_lifecycle_metrics.json")).unwrap(),
    )
    .unwrap();
    let ok = summary["successes"]["count"].as_f64().unwrap();
    assert!(ok > 0.0, "{summary}");
    assert_eq!(
        summary["failures"]["count"].as_f64().unwrap_or(0.0),
        0.0,
        "{summary}"
    );
    // What inference-perf counted is what the simulated engine served: every request, and
    // exactly max_tokens (20, ignore_eos) output tokens each.
    assert_eq!(metric(pod, "vllm:request_success_total"), ok, "{text}");
    assert_eq!(metric(pod, "vllm:generation_tokens_total"), ok * 20.0, "{text}");
    let output_tokens = summary["successes"]["output_tokens"]["total"].as_f64();
    if let Some(total) = output_tokens {
        assert_eq!(total, ok * 20.0, "{summary}");
    }
}
