//! `portcullis up`, the README's first command: control plane + proxy in one process,
//! a file applied at start, data kept across restarts, SIGTERM stops it cleanly.

mod support;

use std::time::Duration;

use support::*;

#[test]
fn quickstart_file_is_a_valid_config() {
    let text = include_str!("../../examples/quickstart.yaml");
    let objects = portcullis_config::parse_documents(text).unwrap();
    let config = portcullis_config::ConfigSet::from_objects(objects).unwrap();
    assert_eq!(config.len(), 4);
}

#[test]
fn up_applies_serves_and_keeps_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let (admin, proxy_admin, listener, upstream) = (free_port(), free_port(), free_port(), free_port());
    let _upstream = start_echo(dir, "up", upstream);
    let config = include_str!("../../examples/quickstart.yaml")
        .replace("port: 8080", &format!("port: {listener}"))
        .replace("127.0.0.1:9001", &format!("127.0.0.1:{upstream}"));
    let file = write_file(dir, "quickstart.yaml", &config);
    let data = dir.join("data");
    let args = |with_file: bool| {
        let mut args = vec![
            "up".to_string(),
            "--data-dir".into(),
            data.to_str().unwrap().into(),
            "--admin-listen".into(),
            format!("127.0.0.1:{admin}"),
            "--proxy-admin-listen".into(),
            format!("127.0.0.1:{proxy_admin}"),
            "--metrics-listen".into(),
            "127.0.0.1:0".into(),
        ];
        if with_file {
            args.extend(["-f".to_string(), file.to_str().unwrap().to_string()]);
        }
        args
    };
    let first_args = args(true);
    let mut up = Process::start(
        "up",
        dir,
        &first_args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    wait_for("up serves the quickstart", TIMEOUT, || {
        served_by(listener, "/hello").as_deref() == Some("up")
    });
    assert_eq!(http_get(proxy_admin, "/readyz").map(|r| r.status), Some(200));
    // The quickstart's /delay route has a 1 s timeout.
    let slow = http_get(listener, "/delay?ms=3000").unwrap();
    assert_eq!(slow.status, 504, "{}", slow.body);
    assert!(slow.body.contains("upstream_timeout"), "{}", slow.body);
    let cp = format!("127.0.0.1:{admin}");
    wait_for("embedded proxy ACKs", TIMEOUT, || {
        proxy_applied(&cp, "embedded").is_some_and(|(_, healthy)| healthy)
    });

    up.terminate();
    let status = up.wait_exit(TIMEOUT).expect("up did not exit on SIGTERM");
    assert!(status.success(), "exit status {status:?}: {}", up.log());

    // Again without -f: the config comes back from the data directory.
    let second_args = args(false);
    let mut up = Process::start(
        "up-again",
        dir,
        &second_args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    wait_for("up serves again from its data", TIMEOUT, || {
        served_by(listener, "/hello").as_deref() == Some("up")
    });
    up.terminate();
    assert!(up.wait_exit(Duration::from_secs(30)).is_some_and(|s| s.success()));
}
