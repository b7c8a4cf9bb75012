//! Harness for end-to-end tests: the real `portcullis` binary as separate processes on
//! loopback, plain HTTP/1.1 over real TCP, and the CLI's own commands.

#![allow(dead_code)] // each test file uses a different part of the harness

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_portcullis");

pub use portcullis_testkit::free_port;

/// A child process killed when dropped; its output goes to a log file kept for failures.
pub struct Process {
    pub name: String,
    child: Child,
    log: PathBuf,
}

impl Process {
    pub fn start(name: &str, dir: &Path, args: &[&str]) -> Process {
        Process::start_within(name, dir, &[], args)
    }

    /// Starts the binary under `wrapper` (e.g. `ip netns exec NS`), which must exec it so
    /// that killing this process kills the binary.
    pub fn start_within(name: &str, dir: &Path, wrapper: &[&str], args: &[&str]) -> Process {
        let mut command = match wrapper.split_first() {
            Some((program, wrapper_args)) => {
                let mut command = Command::new(program);
                command.args(wrapper_args).arg(BIN);
                command
            }
            None => Command::new(BIN),
        };
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .unwrap();
        let child = command
            .args(args)
            .env("PORTCULLIS_LOG", "info,openraft=warn")
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Process {
            name: name.to_string(),
            child,
            log,
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn terminate(&mut self) {
        let pid = self.child.id().to_string();
        let status = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(status.success(), "kill -TERM {pid} failed");
    }

    /// Waits for the process to exit by itself, returning whether it did within `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn is_running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("----- log of {} -----\n{}", self.name, self.log());
        }
    }
}

/// Runs a CLI command to completion.
pub fn cli(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

pub fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

pub fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

pub struct HttpResponse {
    pub status: u16,
    /// The status line and header fields, as received.
    pub head: String,
    pub body: String,
}

/// One HTTP/1.1 GET on a fresh connection. `None` when nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<HttpResponse> {
    http_request(port, "GET", path, None)
}

/// One HTTP/1.1 request on a fresh connection, with a JSON body if given. `None` when
/// nothing answers.
pub fn http_request(port: u16, method: &str, path: &str, json: Option<&str>) -> Option<HttpResponse> {
    http_request_with(port, method, path, &[], json)
}

/// [`http_request`] with extra header fields.
pub fn http_request_with(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    json: Option<&str>,
) -> Option<HttpResponse> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    let body = json.unwrap_or_default();
    let mut content: String = headers
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    if json.is_some() {
        content.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            body.len()
        ));
    }
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n{content}\r\n{body}"
    )
    .ok()?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).ok()?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_string()
    };
    Some(HttpResponse {
        status,
        head: head.to_string(),
        body,
    })
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// A simulated pod that runs one request at a time, so a few requests sent to it directly
/// build a queue (`vllm:num_requests_waiting`) the control plane will read.
pub fn single_seat_pod(dir: &Path, port: u16) -> Process {
    let profile_path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../loadtest/profiles/qwen3-32b-tp2-h100.json"
    );
    let mut profile: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(profile_path).unwrap()).unwrap();
    profile["max_num_seqs"] = 1.into();
    let profile = write_file(dir, &format!("profile-{port}.json"), &profile.to_string());
    let pod = Process::start(
        &format!("pod-{port}"),
        dir,
        &[
            "sim",
            "vllm",
            "--port",
            &port.to_string(),
            "--profile",
            profile.to_str().unwrap(),
        ],
    );
    wait_for("simulated pod", TIMEOUT, || {
        http_get(port, "/health").is_some_and(|r| r.status == 200)
    });
    pod
}

/// What a proxy's picker holds for one pool (its admin port's `/signals?pool=`).
pub fn pool_report(admin: u16, pool: &str) -> serde_json::Value {
    let body = http_get(admin, &format!("/signals?pool={pool}"))
        .map(|r| r.body)
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    json["pools"][pool].clone()
}

/// Polls `check` until it holds or `timeout` passes; panics with `what` on timeout.
pub fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("timed out after {timeout:?} waiting for {what}");
}

/// The `server` field the echo upstream puts in its answers.
pub fn served_by(port: u16, path: &str) -> Option<String> {
    let response = http_get(port, path)?;
    if response.status != 200 {
        return None;
    }
    let json: serde_json::Value = serde_json::from_str(response.body.trim()).ok()?;
    json.get("server")?.as_str().map(str::to_string)
}

pub fn status_json(controlplane: &str) -> serde_json::Value {
    let output = cli(&["status", "-o", "json", "--controlplane", controlplane]);
    assert!(output.status.success(), "status failed: {}", stderr(&output));
    serde_json::from_str(&stdout(&output)).unwrap()
}

pub fn config_version(controlplane: &str) -> u64 {
    status_json(controlplane)["version"].as_u64().unwrap()
}

/// Applied version of one proxy as the control plane reports it, if connected.
pub fn proxy_applied(controlplane: &str, proxy_id: &str) -> Option<(u64, bool)> {
    let status = status_json(controlplane);
    let proxy = status["proxies"]
        .as_array()?
        .iter()
        .find(|p| p["proxyId"] == proxy_id)?
        .clone();
    if proxy["connected"] != true {
        return None;
    }
    Some((proxy["appliedVersion"].as_u64()?, proxy["healthy"] == true))
}

pub fn write_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

pub const TIMEOUT: Duration = Duration::from_secs(30);

/// The built-in echo upstream on 127.0.0.1:`port`, answering with `name`.
pub fn start_echo(dir: &Path, name: &str, port: u16) -> Process {
    let listen = format!("127.0.0.1:{port}");
    Process::start(name, dir, &["echo", "--listen", &listen, "--name", name])
}

/// A control plane on 127.0.0.1:`port`, data in `dir/controlplane`, once it answers.
pub fn start_controlplane(dir: &Path, port: u16) -> Process {
    let listen = format!("127.0.0.1:{port}");
    let data = dir.join("controlplane");
    let process = Process::start(
        "controlplane",
        dir,
        &[
            "controlplane",
            "--listen",
            &listen,
            "--data-dir",
            data.to_str().unwrap(),
            // Tests run control planes side by side; the default port would collide.
            "--metrics-listen",
            "127.0.0.1:0",
        ],
    );
    wait_for("control plane", TIMEOUT, || {
        cli(&["status", "--controlplane", &listen]).status.success()
    });
    process
}

/// A proxy named `id` with health on 127.0.0.1:`admin`, plus any `extra` flags.
pub fn start_proxy(dir: &Path, id: &str, controlplane: &str, admin: u16, extra: &[&str]) -> Process {
    let admin = format!("127.0.0.1:{admin}");
    let mut args = vec![
        "proxy",
        "--id",
        id,
        "--controlplane",
        controlplane,
        "--admin-listen",
        &admin,
    ];
    args.extend_from_slice(extra);
    Process::start(id, dir, &args)
}

/// Writes `yaml` to `dir/file` and applies it; panics with the CLI's error unless accepted.
/// Returns what `apply` printed.
pub fn apply(dir: &Path, file: &str, yaml: &str, controlplane: &str) -> String {
    let output = write_and_apply(dir, file, yaml, controlplane);
    assert!(output.status.success(), "apply {file}: {}", stderr(&output));
    stdout(&output)
}

/// Writes `yaml` to `dir/file` and applies it; panics if it is accepted. Returns the CLI's
/// error.
pub fn refused_apply(dir: &Path, file: &str, yaml: &str, controlplane: &str) -> String {
    let output = write_and_apply(dir, file, yaml, controlplane);
    assert!(!output.status.success(), "apply {file} was accepted:\n{yaml}");
    stderr(&output)
}

fn write_and_apply(dir: &Path, file: &str, yaml: &str, controlplane: &str) -> Output {
    let path = write_file(dir, file, yaml);
    cli(&[
        "apply",
        "-f",
        path.to_str().unwrap(),
        "--controlplane",
        controlplane,
    ])
}

/// Simulated vLLM pods from 127.0.0.1:`port`, once the first is healthy.
pub fn start_sim(dir: &Path, pods: u16, port: u16, time_scale: &str) -> Process {
    let (pods, first) = (pods.to_string(), port.to_string());
    let process = Process::start(
        "sim",
        dir,
        &[
            "sim",
            "vllm",
            "--pods",
            &pods,
            "--port",
            &first,
            "--time-scale",
            time_scale,
        ],
    );
    wait_for("simulator", TIMEOUT, || {
        http_get(port, "/health").is_some_and(|r| r.status == 200)
    });
    process
}

/// A control plane and a proxy on fresh ports, with `config` applied and the proxy ready.
pub struct Gateway {
    pub controlplane: Process,
    pub proxy: Process,
    /// The proxy's admin port (`/readyz`, `/metrics`).
    pub admin: u16,
    /// The control plane's `host:port`, for the CLI.
    pub address: String,
}

impl Gateway {
    /// Applies `config` and waits until the proxy serves the version it made.
    pub fn apply(&self, dir: &Path, config: &str) {
        apply(dir, "change.yaml", config, &self.address);
        let version = config_version(&self.address);
        wait_for("the proxy on the new version", TIMEOUT, || {
            http_get(self.admin, "/status")
                .and_then(|r| serde_json::from_str::<serde_json::Value>(&r.body).ok())
                .is_some_and(|status| status["version"].as_u64() == Some(version))
        });
    }
}

pub fn start_gateway(dir: &Path, config: &str) -> Gateway {
    let (cp_port, admin) = (free_port(), free_port());
    let cp = format!("127.0.0.1:{cp_port}");
    let controlplane = start_controlplane(dir, cp_port);
    let proxy = start_proxy(dir, "gw", &cp, admin, &[]);
    apply(dir, "gateway.yaml", config, &cp);
    wait_for("proxy ready", TIMEOUT, || {
        http_get(admin, "/readyz").is_some_and(|r| r.status == 200)
    });
    Gateway {
        controlplane,
        proxy,
        admin,
        address: cp,
    }
}

/// The sum of metric `name`'s series on `port`'s `/metrics` whose labels contain every one of
/// `labels` (written as in the exposition, e.g. `status="499"`).
pub fn metric(port: u16, name: &str, labels: &[&str]) -> f64 {
    let body = http_get(port, "/metrics").map(|r| r.body).unwrap_or_default();
    body.lines()
        .filter(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .filter(|line| labels.iter().all(|label| line.contains(label)))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
