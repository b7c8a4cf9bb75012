//! Bad input is rejected with a message naming the object and field, nothing is applied,
//! the version does not move and proxies are untouched. Garbage on the gRPC wire gets a
//! gRPC error, never a crash.

mod support;

use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use portcullis_proto::v1;
use support::*;

const GOOD: &str = r#"
apiVersion: portcullis.dev/v1alpha1
kind: Listener
metadata: { name: web }
spec: { address: 127.0.0.1, port: LISTENER_PORT }
---
apiVersion: portcullis.dev/v1alpha1
kind: Backend
metadata: { name: api }
spec: { endpoints: ["127.0.0.1:UPSTREAM_PORT"] }
---
apiVersion: portcullis.dev/v1alpha1
kind: Route
metadata: { name: api }
spec: { listeners: [web], backends: [{ name: api }] }
"#;

/// (file content, text the error must contain). Each would change the config if accepted.
fn bad_files() -> Vec<(&'static str, String, &'static str)> {
    let head = "apiVersion: portcullis.dev/v1alpha1\n";
    vec![
        ("malformed YAML", "kind: [Route\nmetadata: {name: x".to_string(), "malformed YAML"),
        ("unknown kind", format!("{head}kind: Gateway\nmetadata: {{name: x}}\nspec: {{}}\n"), "kind: unknown kind \"Gateway\""),
        (
            "unknown field",
            format!("{head}kind: Backend\nmetadata: {{name: api}}\nspec: {{endpoints: ['127.0.0.1:1'], retries: 3}}\n"),
            "Backend/api: spec.retries: unknown field `retries`",
        ),
        (
            "duplicate names",
            format!("{head}kind: Backend\nmetadata: {{name: b}}\nspec: {{endpoints: ['127.0.0.1:1']}}\n---\n{head}kind: Backend\nmetadata: {{name: b}}\nspec: {{endpoints: ['127.0.0.1:2']}}\n"),
            "Backend/b: metadata.name: defined twice",
        ),
        (
            "missing backend",
            format!("{head}kind: Route\nmetadata: {{name: api}}\nspec: {{listeners: [web], backends: [{{name: nope}}]}}\n"),
            "Route/api: spec.backends[0]: Backend \"nope\" does not exist",
        ),
        ("port 0", format!("{head}kind: Listener\nmetadata: {{name: web}}\nspec: {{port: 0}}\n"), "Listener/web: spec.port: port must be between 1 and 65535"),
        ("port 70000", format!("{head}kind: Listener\nmetadata: {{name: web}}\nspec: {{port: 70000}}\n"), "Listener/web: spec.port:"),
    ]
}

fn wire(text: &str) -> Vec<v1::Object> {
    // Sent raw, bypassing the CLI's local checks, so the control plane's own validation is tested.
    let values: Vec<serde_json::Value> = serde_saphyr::from_multiple(text).unwrap_or_default();
    values
        .into_iter()
        .map(|value| v1::Object {
            kind: String::new(),
            name: String::new(),
            json: value.to_string().into_bytes().into(),
        })
        .collect()
}

async fn grpc_garbage(port: u16, path: &str, body: Vec<u8>) -> (u16, Option<String>) {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    let request = hyper::Request::post(format!("http://127.0.0.1:{port}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), sender.send_request(request))
        .await
        .expect("the server hung on garbage")
        .unwrap();
    let status = response.status().as_u16();
    let header_status = response
        .headers()
        .get("grpc-status")
        .map(|v| v.to_str().unwrap().to_string());
    let collected = tokio::time::timeout(std::time::Duration::from_secs(10), response.into_body().collect())
        .await
        .expect("the server hung on garbage");
    let trailer_status = collected.ok().and_then(|c| {
        c.trailers()
            .and_then(|t| t.get("grpc-status"))
            .map(|v| v.to_str().unwrap().to_string())
    });
    (status, header_status.or(trailer_status))
}

fn start(dir: &Path) -> (Process, Process, Process, String, u16) {
    let (cp_port, listener, upstream, admin) = (free_port(), free_port(), free_port(), free_port());
    let cp_addr = format!("127.0.0.1:{cp_port}");
    let upstream_proc = start_echo(dir, "good", upstream);
    let cp = start_controlplane(dir, cp_port);
    let proxy = start_proxy(dir, "p", &cp_addr, admin, &[]);
    let good = GOOD
        .replace("LISTENER_PORT", &listener.to_string())
        .replace("UPSTREAM_PORT", &upstream.to_string());
    apply(dir, "good.yaml", &good, &cp_addr);
    wait_for("proxy serves", TIMEOUT, || {
        served_by(listener, "/").as_deref() == Some("good")
    });
    (upstream_proc, cp, proxy, cp_addr, listener)
}

/// Before an upgrade: the whole config exported, checked by a binary's own rules with no
/// control plane, the rules across objects included.
#[tokio::test(flavor = "multi_thread")]
async fn the_exported_config_is_checked_whole_without_a_control_plane() {
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, _cp, _proxy, cp_addr, _listener) = start(dir.path());
    let exported = cli(&["get", "all", "--controlplane", &cp_addr]);
    assert!(exported.status.success(), "{}", stderr(&exported));
    let exported = stdout(&exported);
    for object in ["kind: Listener", "kind: Backend", "kind: Route"] {
        assert!(exported.contains(object), "{object} missing from:\n{exported}");
    }
    let file = write_file(dir.path(), "exported.yaml", &exported);
    let nowhere = format!("127.0.0.1:{}", free_port());
    let checked = cli(&[
        "validate",
        "--local",
        "-f",
        file.to_str().unwrap(),
        "--controlplane",
        &nowhere,
    ]);
    assert!(checked.status.success(), "{}", stderr(&checked));
    assert!(
        stdout(&checked).contains("valid as a whole config of 3 objects"),
        "{}",
        stdout(&checked)
    );

    // A rule across objects (a route to a backend the file lacks), with no node to ask.
    let partial = exported
        .split("---\n")
        .filter(|document| !document.lines().any(|line| line == "kind: Backend"))
        .collect::<Vec<_>>()
        .join("---\n");
    let file = write_file(dir.path(), "partial.yaml", &partial);
    let refused = cli(&[
        "validate",
        "--local",
        "-f",
        file.to_str().unwrap(),
        "--controlplane",
        &nowhere,
    ]);
    assert!(!refused.status.success(), "accepted:\n{partial}");
    assert!(
        stderr(&refused).contains("Backend \"api\" does not exist"),
        "{}",
        stderr(&refused)
    );
    let named = cli(&["get", "all", "api", "--controlplane", &cp_addr]);
    assert!(stderr(&named).contains("name a kind"), "{}", stderr(&named));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_config_is_rejected_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, mut cp, mut proxy, cp_addr, listener) = start(dir.path());
    let version = config_version(&cp_addr);
    let before = stdout(&cli(&["get", "routes", "-o", "json", "--controlplane", &cp_addr]));
    let mut client = v1::admin_client::AdminClient::connect(format!("http://{cp_addr}"))
        .await
        .unwrap();

    for (what, text, expected) in bad_files() {
        // Through the CLI.
        let file = write_file(dir.path(), "bad.yaml", &text);
        let output = cli(&["apply", "-f", file.to_str().unwrap(), "--controlplane", &cp_addr]);
        assert!(!output.status.success(), "{what}: CLI accepted it");
        assert!(stderr(&output).contains(expected), "{what}: {}", stderr(&output));
        // Straight to the admin API, so the control plane's own checks are what is tested.
        if what != "malformed YAML" {
            let error = client
                .apply(v1::ApplyRequest {
                    objects: wire(&text),
                    expected_version: None,
                })
                .await
                .unwrap_err();
            assert_eq!(error.code(), tonic::Code::InvalidArgument, "{what}: {error:?}");
            assert!(error.message().contains(expected), "{what}: {}", error.message());
            let error = client
                .validate(v1::ApplyRequest {
                    objects: wire(&text),
                    expected_version: None,
                })
                .await
                .unwrap_err();
            assert_eq!(
                error.code(),
                tonic::Code::InvalidArgument,
                "{what} (validate): {error:?}"
            );
        }
        assert_eq!(config_version(&cp_addr), version, "{what}: the version moved");
    }

    // Not JSON at all, and optimistic concurrency with a stale version.
    let garbage = v1::Object {
        kind: "Route".into(),
        name: "x".into(),
        json: b"{not json".to_vec().into(),
    };
    let error = client
        .apply(v1::ApplyRequest {
            objects: vec![garbage],
            expected_version: None,
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::InvalidArgument, "{error:?}");
    let good = client
        .list(v1::ListRequest::default())
        .await
        .unwrap()
        .into_inner()
        .objects;
    let error = client
        .apply(v1::ApplyRequest {
            objects: good,
            expected_version: Some(version + 7),
        })
        .await
        .unwrap_err();
    assert_eq!(error.code(), tonic::Code::FailedPrecondition, "{error:?}");
    // Deleting what a route still uses, or what does not exist.
    let error = client
        .delete(v1::DeleteRequest {
            objects: vec![v1::ObjectRef {
                kind: "Backend".into(),
                name: "api".into(),
            }],
            expected_version: None,
        })
        .await
        .unwrap_err();
    assert!(
        error.message() == "Backend/api: still referenced by Route/api at spec.backends[0]",
        "{}",
        error.message()
    );
    let error = client
        .delete(v1::DeleteRequest {
            objects: vec![v1::ObjectRef {
                kind: "Backend".into(),
                name: "ghost".into(),
            }],
            expected_version: None,
        })
        .await
        .unwrap_err();
    assert!(error.message().contains("Backend/ghost"), "{}", error.message());

    assert_eq!(config_version(&cp_addr), version, "the version moved");
    assert_eq!(
        stdout(&cli(&["get", "routes", "-o", "json", "--controlplane", &cp_addr])),
        before
    );
    assert_eq!(proxy_applied(&cp_addr, "p"), Some((version, true)));
    assert_eq!(served_by(listener, "/").as_deref(), Some("good"));
    assert!(cp.is_running() && proxy.is_running());
}

#[tokio::test(flavor = "multi_thread")]
async fn garbage_grpc_gets_a_grpc_error_not_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let (_upstream, mut cp, _proxy, cp_addr, _listener) = start(dir.path());
    let port: u16 = cp_addr.rsplit_once(':').unwrap().1.parse().unwrap();
    let version = config_version(&cp_addr);
    // A frame header promising 1,000 bytes followed by 5; random bytes; a valid frame of junk protobuf.
    let truncated = [vec![0u8, 0, 0, 3, 232], vec![1, 2, 3, 4, 5]].concat();
    let random: Vec<u8> = (0..64u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 7) as u8)
        .collect();
    let junk_protobuf = [vec![0u8, 0, 0, 0, 6], vec![0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]].concat();
    for path in [
        "/portcullis.v1.Admin/Apply",
        "/portcullis.v1.ConfigStream/Subscribe",
        "/portcullis.v1.Raft/AppendEntries",
    ] {
        for body in [truncated.clone(), random.clone(), junk_protobuf.clone()] {
            let (http_status, grpc_status) = grpc_garbage(port, path, body).await;
            assert_eq!(http_status, 200, "{path}");
            let grpc_status = grpc_status.unwrap_or_else(|| panic!("{path}: no grpc-status"));
            assert_ne!(grpc_status, "0", "{path} accepted garbage");
        }
    }
    assert!(cp.is_running(), "the control plane died");
    assert_eq!(config_version(&cp_addr), version);
}
