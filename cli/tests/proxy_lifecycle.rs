//! What a proxy cannot apply it NACKs, visibly, and keeps serving the previous version;
//! SSE streams through event by event; SIGTERM drains in-flight requests.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use support::*;

fn objects(listener: u16, upstream: u16, extra_listener: Option<u16>) -> String {
    let mut text = format!(
        r#"
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: {{ name: web }}
spec: {{ address: 127.0.0.1, port: {listener} }}
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: {{ name: echo }}
spec: {{ endpoints: ["127.0.0.1:{upstream}"] }}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {{ name: all }}
spec: {{ listeners: [web], backends: [{{ name: echo }}], timeout: 10s }}
"#
    );
    if let Some(port) = extra_listener {
        text.push_str(&format!(
            "---\napiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {{ name: taken }}\nspec: {{ address: 127.0.0.1, port: {port} }}\n"
        ));
    }
    text
}

struct Setup {
    _upstream: Process,
    _controlplane: Process,
    proxy: Process,
    cp_addr: String,
    listener: u16,
    upstream: u16,
}

fn setup(dir: &Path) -> Setup {
    let (cp_port, listener, upstream, admin) = (free_port(), free_port(), free_port(), free_port());
    let cp_addr = format!("127.0.0.1:{cp_port}");
    let upstream_process = start_echo(dir, "echo", upstream);
    let controlplane = start_controlplane(dir, cp_port);
    let proxy = start_proxy(dir, "p", &cp_addr, admin, &["--drain-grace", "10s"]);
    apply(dir, "v1.yaml", &objects(listener, upstream, None), &cp_addr);
    wait_for("proxy serves", TIMEOUT, || {
        served_by(listener, "/").as_deref() == Some("echo")
    });
    Setup {
        _upstream: upstream_process,
        _controlplane: controlplane,
        proxy,
        cp_addr,
        listener,
        upstream,
    }
}

#[test]
fn unbindable_listener_is_nacked_and_previous_version_keeps_serving() {
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path());
    let good = config_version(&s.cp_addr);
    wait_for("ACK of the first version", TIMEOUT, || {
        proxy_applied(&s.cp_addr, "p") == Some((good, true))
    });

    // The upstream already holds this port: valid config, but this proxy cannot enforce it.
    let taken = objects(s.listener, s.upstream, Some(s.upstream));
    apply(dir.path(), "taken.yaml", &taken, &s.cp_addr);
    let bad = config_version(&s.cp_addr);
    assert!(bad > good);
    wait_for("NACK reported", TIMEOUT, || {
        proxy_applied(&s.cp_addr, "p") == Some((good, false))
    });
    let status = status_json(&s.cp_addr);
    let error = status["proxies"][0]["lastError"].as_str().unwrap().to_string();
    assert!(
        error.contains(&s.upstream.to_string()),
        "the reason should name the port: {error}"
    );
    let table = stdout(&cli(&["status", "--controlplane", &s.cp_addr]));
    assert!(table.contains("rejecting"), "{table}");
    assert_eq!(
        served_by(s.listener, "/").as_deref(),
        Some("echo"),
        "previous version must keep serving"
    );

    // Fixing the config heals the proxy.
    apply(
        dir.path(),
        "fixed.yaml",
        &objects(s.listener, s.upstream, None),
        &s.cp_addr,
    );
    let deleted = cli(&["delete", "listener", "taken", "--controlplane", &s.cp_addr]);
    assert!(deleted.status.success(), "{}", stderr(&deleted));
    let fixed = config_version(&s.cp_addr);
    wait_for("healthy again", TIMEOUT, || {
        proxy_applied(&s.cp_addr, "p") == Some((fixed, true))
    });
}

#[test]
fn sse_flows_event_by_event_and_sigterm_drains() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = setup(dir.path());

    // The upstream sends an event every 700 ms; the first must reach us long before the last is sent.
    let mut stream = TcpStream::connect(("127.0.0.1", s.listener)).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let started = Instant::now();
    write!(
        stream,
        "GET /sse?events=4&interval_ms=700 HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "stream ended before the first event"
        );
        if line.starts_with("data: event 0") {
            break;
        }
    }
    let first_event = started.elapsed();
    assert!(
        first_event < Duration::from_millis(1500),
        "first event took {first_event:?}: the body was buffered"
    );
    let mut rest = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 0 {
        rest.push_str(&line);
        line.clear();
    }
    assert!(rest.contains("data: event 3"), "stream cut short");

    // An in-flight slow request survives SIGTERM; the proxy exits once it is done.
    let port = s.listener;
    let in_flight = std::thread::spawn(move || http_get(port, "/delay?ms=1500"));
    std::thread::sleep(Duration::from_millis(300));
    s.proxy.terminate();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        http_get(port, "/").is_none(),
        "a draining proxy must stop accepting"
    );
    let response = in_flight.join().unwrap().expect("in-flight request was cut");
    assert_eq!(response.status, 200);
    let exit = s
        .proxy
        .wait_exit(TIMEOUT)
        .expect("proxy did not exit after draining");
    assert!(exit.success(), "proxy exit status {exit:?}");
}
