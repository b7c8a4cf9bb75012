//! Every kind of config object, one file each. Adding a kind: write its spec type
//! implementing [`crate::KindSpec`] in a new file here, and add one line to `kinds!` below.

use crate::kind::KindInfo;

macro_rules! kinds {
    ($($module:ident :: $spec:ident),* $(,)?) => {
        $(mod $module;)*
        $(pub use $module::*;)*
        /// Registration order is the order of kinds in listings and in a config.
        pub(crate) static REGISTRY: &[&KindInfo] = &[$(<$spec as crate::kind::KindSpec>::INFO),*];
    };
}

kinds! {
    listener::ListenerSpec,
    route::RouteSpec,
    backend::BackendSpec,
    inference_pool::InferencePoolSpec,
    header_policy::HeaderPolicySpec,
    rate_limit_policy::RateLimitPolicySpec,
    mcp_backend::McpBackendSpec,
    mcp_authorization::McpAuthorizationSpec,
    mcp_tool_pins::McpToolPinsSpec,
    guardrail::GuardrailSpec,
}
