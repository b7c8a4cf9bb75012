//! Validation exists once: whatever the control plane accepts, a proxy compiles. Generated
//! configs mix valid and invalid values (control characters, odd hosts, unnormalized paths).

use std::sync::Arc;

use portcullis_config::{parse_documents, ConfigSet};
use proptest::prelude::*;

use crate::config_state::{compile, Snapshot};
use crate::telemetry::Telemetry;
use crate::upstream::Upstream;

fn route_yaml() -> impl Strategy<Value = String> {
    (
        "[a-z][a-z0-9-]{0,8}",
        prop_oneof!["[a-z*.-]{1,12}", Just("*.example.com".to_string())],
        prop_oneof!["/[a-zA-Z0-9%./~_-]{0,12}", "[a-z/]{0,4}"],
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{0,10}",
        "[\\x00-\\x1f\\x7f -~]{0,12}",
        prop_oneof![Just("GET"), Just("POST"), Just("get"), Just("BREW")],
    )
        .prop_map(|(name, host, path, header, value, method)| {
            let value = serde_json::to_string(&value).unwrap_or_default();
            let host = serde_json::to_string(&host).unwrap_or_default();
            let path = serde_json::to_string(&path).unwrap_or_default();
            format!(
                "apiVersion: portcullis.dev/v1alpha1\nkind: Route\nmetadata: {{name: r-{name}}}\nspec: {{listeners: [web], backends: [{{name: up}}], hostnames: [{host}], matches: [{{path: {{prefix: {path}}}, method: {method}, headers: [{{name: {header:?}, value: {value}}}]}}]}}\n---\n"
            )
        })
}

fn header_policy_yaml() -> impl Strategy<Value = String> {
    ("[A-Za-z0-9:-]{0,10}", "[\\x00-\\x1f\\x7f -~]{0,12}").prop_map(|(name, value)| {
        let value = serde_json::to_string(&value).unwrap_or_default();
        format!(
            "apiVersion: portcullis.dev/v1alpha1\nkind: HeaderPolicy\nmetadata: {{name: hp}}\nspec: {{targetRefs: [{{kind: Listener, name: web}}], request: {{set: [{{name: {name:?}, value: {value}}}]}}}}\n---\n"
        )
    })
}

const BASE: &str = "apiVersion: portcullis.dev/v1alpha1\nkind: Listener\nmetadata: {name: web}\nspec: {port: 8080}\n---\napiVersion: portcullis.dev/v1alpha1\nkind: Backend\nmetadata: {name: up}\nspec: {endpoints: ['127.0.0.1:9000']}\n---\n";

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn what_validation_accepts_a_proxy_compiles(routes in prop::collection::vec(route_yaml(), 1..4), policy in header_policy_yaml()) {
        let text = format!("{BASE}{}{policy}", routes.concat());
        let Ok(objects) = parse_documents(&text) else { return Ok(()) };
        let Ok(config) = ConfigSet::from_objects(objects) else { return Ok(()) };
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let result = runtime.block_on(async {
            let telemetry = Arc::new(Telemetry::new(super::support::quiet_telemetry()).unwrap());
            let upstream = Upstream::new(telemetry, crate::placements::outbox().0, None);
            compile(1, config, &Snapshot::default(), &upstream).map(|_| ())
        });
        prop_assert!(result.is_ok(), "accepted but not compiled: {:?}\n{text}", result.err());
    }
}
