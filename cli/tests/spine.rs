//! The spine, end to end: control plane, two proxies and upstreams as separate processes.
//! Apply → both proxies serve; change → both converge on one version; control plane
//! killed → proxies keep serving; a proxy restarted meanwhile serves from its cache;
//! control plane restarted → config read back from disk, proxies reconnect.

mod support;

use std::path::Path;
use std::time::Duration;

use support::*;

fn config(upstream_port: u16, listener_a: u16, listener_b: u16) -> String {
    format!(
        r#"
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: {{ name: edge-a, labels: {{ shard: a }} }}
spec: {{ address: 127.0.0.1, port: {listener_a} }}
---
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: {{ name: edge-b, labels: {{ shard: b }} }}
spec: {{ address: 127.0.0.1, port: {listener_b} }}
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: {{ name: hello }}
spec: {{ endpoints: ["127.0.0.1:{upstream_port}"] }}
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: {{ name: hello }}
spec:
  listeners: [edge-a, edge-b]
  matches: [{{ path: {{ prefix: /hello }} }}]
  backends: [{{ name: hello }}]
"#
    )
}

struct Ports {
    controlplane: u16,
    listener_a: u16,
    listener_b: u16,
    admin_a: u16,
    admin_b: u16,
}

/// A proxy serving one shard, with an on-disk cache so it can restart without the control plane.
fn start_sharded_proxy(dir: &Path, name: &str, shard: &str, admin: u16, controlplane: &str) -> Process {
    let cache = dir.join(format!("{name}-cache"));
    start_proxy(
        dir,
        name,
        controlplane,
        admin,
        &["--shard", shard, "--cache-dir", cache.to_str().unwrap()],
    )
}

fn ready(admin_port: u16) -> bool {
    http_get(admin_port, "/readyz").is_some_and(|r| r.status == 200)
}

#[test]
fn apply_converge_survive_controlplane_loss_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let ports = Ports {
        controlplane: free_port(),
        listener_a: free_port(),
        listener_b: free_port(),
        admin_a: free_port(),
        admin_b: free_port(),
    };
    let (up1, up2) = (free_port(), free_port());
    let _upstream1 = start_echo(dir, "up1", up1);
    let _upstream2 = start_echo(dir, "up2", up2);
    let cp_addr = format!("127.0.0.1:{}", ports.controlplane);
    let mut controlplane = start_controlplane(dir, ports.controlplane);

    let mut proxy_a = start_sharded_proxy(dir, "proxy-a", "shard=a", ports.admin_a, &cp_addr);
    let mut proxy_b = start_sharded_proxy(dir, "proxy-b", "shard=b", ports.admin_b, &cp_addr);
    // Nothing applied yet: alive, not ready.
    wait_for("proxies alive", TIMEOUT, || {
        http_get(ports.admin_a, "/livez").is_some_and(|r| r.status == 200)
            && http_get(ports.admin_b, "/livez").is_some_and(|r| r.status == 200)
    });
    assert!(!ready(ports.admin_a), "a proxy with no config must not be ready");

    // Apply → both proxies serve the route, each on its own shard's listener.
    let applied = apply(
        dir,
        "v1.yaml",
        &config(up1, ports.listener_a, ports.listener_b),
        &cp_addr,
    );
    assert!(applied.contains("Route/hello created"), "{applied}");
    let v1 = config_version(&cp_addr);
    wait_for("both proxies serve v1", TIMEOUT, || {
        served_by(ports.listener_a, "/hello").as_deref() == Some("up1")
            && served_by(ports.listener_b, "/hello").as_deref() == Some("up1")
    });
    assert!(ready(ports.admin_a) && ready(ports.admin_b));
    let no_route = http_get(ports.listener_a, "/elsewhere").unwrap();
    assert_eq!(no_route.status, 404, "unmatched path: {}", no_route.body);

    // Change → both converge on the same, newer version.
    let applied = apply(
        dir,
        "v2.yaml",
        &config(up2, ports.listener_a, ports.listener_b),
        &cp_addr,
    );
    assert!(applied.contains("Backend/hello configured"), "{applied}");
    let v2 = config_version(&cp_addr);
    assert!(v2 > v1);
    wait_for("both proxies serve v2", TIMEOUT, || {
        served_by(ports.listener_a, "/hello").as_deref() == Some("up2")
            && served_by(ports.listener_b, "/hello").as_deref() == Some("up2")
    });
    wait_for("both proxies ACK v2", TIMEOUT, || {
        proxy_applied(&cp_addr, "proxy-a") == Some((v2, true))
            && proxy_applied(&cp_addr, "proxy-b") == Some((v2, true))
    });

    // Control plane gone → proxies keep serving their last good version.
    controlplane.kill();
    for _ in 0..10 {
        assert_eq!(served_by(ports.listener_a, "/hello").as_deref(), Some("up2"));
        assert_eq!(served_by(ports.listener_b, "/hello").as_deref(), Some("up2"));
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        ready(ports.admin_a),
        "losing the control plane must not make a serving proxy unready"
    );

    // A proxy restarted while the control plane is down serves from its on-disk cache.
    proxy_b.terminate();
    assert!(
        proxy_b.wait_exit(TIMEOUT).is_some(),
        "proxy-b did not exit on SIGTERM"
    );
    assert!(
        http_get(ports.listener_b, "/hello").is_none(),
        "a stopped proxy must not answer"
    );
    let mut proxy_b = start_sharded_proxy(dir, "proxy-b", "shard=b", ports.admin_b, &cp_addr);
    wait_for("restarted proxy-b serves from cache", TIMEOUT, || {
        served_by(ports.listener_b, "/hello").as_deref() == Some("up2")
    });
    assert!(ready(ports.admin_b));

    // Control plane back on the same data dir → the config was read back from disk.
    let _controlplane = start_controlplane(dir, ports.controlplane);
    assert_eq!(config_version(&cp_addr), v2, "version after restart");
    let route = cli(&["get", "route", "hello", "--controlplane", &cp_addr]);
    assert!(route.status.success(), "{}", stderr(&route));
    assert!(stdout(&route).contains("prefix: /hello"), "{}", stdout(&route));
    let backend = cli(&["get", "backends", "-o", "json", "--controlplane", &cp_addr]);
    assert!(
        stdout(&backend).contains(&format!("127.0.0.1:{up2}")),
        "{}",
        stdout(&backend)
    );

    // Proxies reconnect by themselves and follow new versions again.
    wait_for("proxies reconnect", TIMEOUT, || {
        proxy_applied(&cp_addr, "proxy-a") == Some((v2, true))
            && proxy_applied(&cp_addr, "proxy-b") == Some((v2, true))
    });
    apply(
        dir,
        "v3.yaml",
        &config(up1, ports.listener_a, ports.listener_b),
        &cp_addr,
    );
    let v3 = config_version(&cp_addr);
    assert!(v3 > v2);
    wait_for("both proxies serve v3", TIMEOUT, || {
        served_by(ports.listener_a, "/hello").as_deref() == Some("up1")
            && served_by(ports.listener_b, "/hello").as_deref() == Some("up1")
    });
    wait_for("both proxies ACK v3", TIMEOUT, || {
        proxy_applied(&cp_addr, "proxy-a") == Some((v3, true))
            && proxy_applied(&cp_addr, "proxy-b") == Some((v3, true))
    });

    assert!(proxy_a.is_running() && proxy_b.is_running());
}
