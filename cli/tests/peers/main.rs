//! Peers nobody here wrote, against Portcullis' test servers, straight and through the
//! proxy: the official `openai` Python client streaming from the vLLM simulator, the
//! official `mcp` Python SDK against the MCP gateway (`mcp.rs`),
//! `inference-perf` against the simulator (its figures checked against the simulator's
//! counters and against our own load generator), `portcullis loadtest` comparing the
//! direct path with the gateway, and a guardrail checker written with `grpcio` from the
//! `.proto` alone.
//!
//! The Python peers live in the virtualenv that `./scripts/test` creates (`.venv`, or
//! `$PORTCULLIS_VENV`).

mod mcp;
#[allow(dead_code)] // the MCP tests' wire helpers; the peer tests use a few
#[path = "../mcp/wire.rs"]
mod mcp_wire;
#[path = "../support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use mcp::mcp_route;
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

/// Runs `portcullis loadtest` on `scenario`; returns the directory holding its reports.
fn run_loadtest(dir: &Path, name: &str, scenario: &str) -> PathBuf {
    let file = write_file(dir, &format!("{name}.yaml"), scenario);
    let out = dir.join(name);
    let run = cli(&[
        "loadtest",
        "-f",
        file.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--no-progress",
    ]);
    assert!(
        run.status.success(),
        "loadtest {name}: {}{}",
        stdout(&run),
        stderr(&run)
    );
    out
}

/// A gateway routing every request on a fresh listener to `upstream`; the listener's port.
fn gateway(dir: &Path, upstream: u16) -> (Gateway, u16) {
    let port = free_port();
    let config = format!(
        "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {{name: upstream}}\nspec: {{endpoints: ['127.0.0.1:{upstream}']}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: all}}\nspec: {{listeners: [gw], backends: [{{name: upstream}}], timeout: 60s}}\n"
    );
    (start_gateway(dir, &config), port)
}

#[test]
fn openai_client_streams_from_the_simulator_direct_and_through_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _sim = start_sim(dir.path(), 1, pod, "10");
    let direct = peer("openai_stream.py", &[&format!("http://127.0.0.1:{pod}")]);
    assert!(direct.starts_with("OK"), "{direct}");
    let (_gateway, gateway_port) = gateway(dir.path(), pod);
    let through = peer(
        "openai_stream.py",
        &[&format!("http://127.0.0.1:{}", gateway_port)],
    );
    assert!(through.starts_with("OK"), "{through}");
}

/// A gateway serving an LLM route: an InferencePool over `pods`, its model also reachable
/// by the alias `qwen`; the listener's port.
fn pool_gateway(dir: &Path, pods: &[u16]) -> (Gateway, u16) {
    let port = free_port();
    let endpoints: Vec<String> = pods.iter().map(|pod| format!("'127.0.0.1:{pod}'")).collect();
    let config = format!(
        "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{name: gw}}\nspec: {{address: 127.0.0.1, port: {port}}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: InferencePool\nmetadata: {{name: qwen}}\nspec: {{endpoints: [{}], models: [{{name: Qwen/Qwen3-32B, aliases: [qwen]}}]}}\n---\n\
         apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: llm}}\nspec: {{listeners: [gw], backends: [{{kind: InferencePool, name: qwen}}], timeout: 60s}}\n",
        endpoints.join(", ")
    );
    (start_gateway(dir, &config), port)
}

#[test]
fn openai_client_and_inference_perf_through_an_inference_pool() {
    let dir = tempfile::tempdir().unwrap();
    let pods = [free_port(), free_port()];
    let _sims = pods.map(|pod| start_sim(dir.path(), 1, pod, "10"));
    let (_gateway, gateway_port) = pool_gateway(dir.path(), &pods);
    let url = format!("http://127.0.0.1:{}", gateway_port);
    // Streamed chunk by chunk through the picker, under the alias the pods do not know.
    let through = peer("openai_stream.py", &[&url, "qwen"]);
    assert!(through.starts_with("OK"), "{through}");

    let out = dir.path().join("inference-perf");
    std::fs::create_dir_all(&out).unwrap();
    let venv = python().parent().unwrap().parent().unwrap().to_path_buf();
    let run = Command::new("bash")
        .arg(repo_root().join("loadtest/peers/inference_perf/run.sh"))
        .arg(&url)
        .arg(&out)
        .env("PORTCULLIS_VENV", &venv)
        .env("IP_DURATION", "3")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        run.status.success(),
        "inference-perf through the pool failed:\n{text}"
    );
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
    // Every request inference-perf counted reached a pod (plus the openai client's one).
    let served: f64 = pods
        .iter()
        .map(|&pod| metric(pod, "vllm:request_success_total", &[]))
        .sum();
    assert_eq!(served, ok + 1.0, "{text}");
}

#[test]
fn a_python_grpcio_guardrail_checker_generated_from_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let (checker, server, port) = (free_port(), free_port(), free_port());
    let proto = repo_root().join("proto");
    let _checker = PythonPeer::start(
        dir.path(),
        "guardrail_server.py",
        &[proto.to_str().unwrap(), &checker.to_string()],
    );
    let _mcp = Process::start(
        "mcp",
        dir.path(),
        &[
            "mcp-server",
            "--listen",
            &format!("127.0.0.1:{server}"),
            "--tools",
            "0",
        ],
    );
    for listening in [checker, server] {
        wait_for("the checker and the MCP server", TIMEOUT, || {
            std::net::TcpStream::connect(("127.0.0.1", listening)).is_ok()
        });
    }
    let config = format!(
        "{}---\napiVersion: portcullis.dev/v1alpha1\nkind: Guardrail\nmetadata: {{name: py}}\nspec:\n  targetRefs: [{{kind: McpBackend, name: tools}}]\n  phases: [McpRequest]\n  service: {{replicas: ['127.0.0.1:{checker}']}}\n",
        mcp_route(port, &[("math", server)])
    );
    let _gateway = start_gateway(dir.path(), &config);
    let wire = mcp_wire::Wire::initialize(port);
    let (_, passed) = wire.call("get-sum", serde_json::json!({"a": 1, "b": 2}));
    assert_eq!(passed["result"]["content"][0]["text"], "3", "{passed}");
    let (status, denied) = wire.call("get-sum", serde_json::json!({"a": 2, "b": 2}));
    assert_eq!(status, 200);
    assert_eq!(denied["error"]["code"], -32012, "{denied}");
    assert_eq!(
        denied["error"]["data"]["reason"],
        "python checker: get-sum needs a == 1, not 2"
    );
    let (_, echoed) = wire.call("echo", serde_json::json!({"message": "untouched"}));
    assert_eq!(echoed["result"]["content"][0]["text"], "untouched");
}

#[test]
fn guardrails_check_sse_answers_of_the_python_mcp_sdk() {
    let dir = tempfile::tempdir().unwrap();
    let (server, checker, port) = (free_port(), free_port(), free_port());
    // The SDK answers calls on an event stream: the result is checked event by event.
    let _python_server = PythonPeer::start(dir.path(), "mcp_server.py", &[&server.to_string()]);
    let _checker = Process::start(
        "checker",
        dir.path(),
        &["guardrail-server", "--listen", &format!("127.0.0.1:{checker}")],
    );
    for listening in [server, checker] {
        wait_for("the MCP server and the checker", TIMEOUT, || {
            std::net::TcpStream::connect(("127.0.0.1", listening)).is_ok()
        });
    }
    let config = format!(
        "{}---\napiVersion: portcullis.dev/v1alpha1\nkind: Guardrail\nmetadata: {{name: rust}}\nspec:\n  targetRefs: [{{kind: McpBackend, name: tools}}]\n  phases: [McpRequest, McpResponse]\n  service: {{replicas: ['127.0.0.1:{checker}']}}\n",
        mcp_route(port, &[("py", server)])
    );
    let _gateway = start_gateway(dir.path(), &config);
    let wire = mcp_wire::Wire::initialize(port);
    let (_, redacted) = wire.call("echo", serde_json::json!({"message": "my secret plan"}));
    assert_eq!(
        redacted["result"]["content"][0]["text"], "my [redacted] plan",
        "{redacted}"
    );
    let (_, passed) = wire.call("get-sum", serde_json::json!({"a": 1, "b": 2}));
    assert_eq!(passed["result"]["content"][0]["text"], "3", "{passed}");
    let (_, denied) = wire.call("get-sum", serde_json::json!({"a": 2, "b": 2}));
    assert_eq!(denied["error"]["code"], -32012, "{denied}");
}

/// A Python peer running as a server; killed when dropped.
struct PythonPeer(std::process::Child);

impl PythonPeer {
    fn start(dir: &Path, script: &str, args: &[&str]) -> PythonPeer {
        PythonPeer::start_with(dir, script, args, &[])
    }

    fn start_with(dir: &Path, script: &str, args: &[&str], env: &[(&str, &str)]) -> PythonPeer {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(format!("{script}.log")))
            .unwrap();
        let child = Command::new(python())
            .arg(repo_root().join("loadtest/peers").join(script))
            .args(args)
            .envs(env.iter().copied())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        PythonPeer(child)
    }
}

impl Drop for PythonPeer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn loadtest_compares_the_direct_path_with_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    let _sim = start_sim(dir.path(), 1, pod, "20");
    let (_gateway, gateway_port) = gateway(dir.path(), pod);
    let scenario = format!(
        "api: {{type: chat, streaming: true}}\nmodel: Qwen/Qwen3-32B\ntargets:\n  - {{name: direct, url: 'http://127.0.0.1:{pod}'}}\n  - {{name: gateway, url: 'http://127.0.0.1:{}'}}\n\
         data: {{type: shared_prefix, num_groups: 2, num_prompts_per_group: 2, system_prompt_len: 256, question_len: 32, output_len: 16}}\n\
         load: {{type: poisson, stages: [{{rate: 4, duration: 2s}}, {{rate: 8, duration: 2s}}], seed: 7}}\nrequest_timeout: 60s\n",
        gateway_port
    );
    let out = run_loadtest(dir.path(), "results", &scenario);
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
    assert_all_succeeded(&csv);
}

/// Sum of every series of one metric on a simulated pod's `/metrics`.

#[test]
fn inference_perf_agrees_with_the_simulator_counters_and_our_load_generator() {
    let dir = tempfile::tempdir().unwrap();
    let pod = free_port();
    // Time scale 1: latencies are compared with inference-perf's, so they must be real.
    let _sim = start_sim(dir.path(), 1, pod, "1");
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
    assert_eq!(metric(pod, "vllm:request_success_total", &[]), ok, "{text}");
    assert_eq!(
        metric(pod, "vllm:generation_tokens_total", &[]),
        ok * 20.0,
        "{text}"
    );

    // Our load generator on the same workload and pod measures the same latencies. run.sh
    // sends 4 groups × 3 prompts of 200 + 50 Qwen tokens, which the simulator's stand-in
    // tokenizer counts as ≈ 374 (300 + 74), 20 output tokens, Poisson stages of 2 and 4 req/s.
    let scenario = format!(
        "api: {{type: completion, streaming: true}}\nmodel: Qwen/Qwen3-32B\ntargets: [{{name: sim, url: 'http://127.0.0.1:{pod}'}}]\n\
         data: {{type: shared_prefix, num_groups: 4, num_prompts_per_group: 3, system_prompt_len: 300, question_len: 74, output_len: 20}}\n\
         load: {{type: poisson, stages: [{{rate: 2, duration: 5s}}, {{rate: 4, duration: 5s}}], seed: 3}}\n"
    );
    let ours_dir = run_loadtest(dir.path(), "ours", &scenario);
    let ours: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ours_dir.join("report.json")).unwrap()).unwrap();
    let stages = ours["targets"][0]["stages"].as_array().unwrap();
    let our_median = |metric: &str| {
        stages
            .iter()
            .map(|s| s["successes"]["latency"][metric]["p50"].as_f64().unwrap())
            .sum::<f64>()
            / stages.len() as f64
    };
    let their_median = |metric: &str| {
        summary["successes"]["latency"][metric]["median"]
            .as_f64()
            .unwrap()
    };
    for metric in ["time_to_first_token", "time_per_output_token"] {
        let (ours, theirs) = (our_median(metric), their_median(metric));
        // Two clients (Python vs Rust) on a shared machine: the same figure within 3x, or
        // within 50 ms when a scheduling stall dwarfs a latency of a few milliseconds.
        let close = (ours / theirs < 3.0 && theirs / ours < 3.0) || (ours - theirs).abs() < 0.050;
        assert!(
            ours > 0.0 && theirs > 0.0 && close,
            "{metric}: ours {ours:.4}s, inference-perf {theirs:.4}s"
        );
        eprintln!("{metric} median: ours {ours:.4}s, inference-perf {theirs:.4}s");
    }
}

/// Every target × stage row of a `portcullis loadtest` CSV served requests and failed none.
fn assert_all_succeeded(csv: &str) {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let column = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let (successes, failures) = (column("successes"), column("failures"));
    for row in lines {
        let cells: Vec<&str> = row.split(',').collect();
        let ok: u64 = cells[successes].parse().unwrap();
        let failed: u64 = cells[failures].parse().unwrap();
        assert!(ok > 0 && failed == 0, "{row}");
    }
}
