//! Compiles `portcullis/v1/*.proto` and `portcullis/guardrail/v1/guardrail.proto` with protox (pure Rust), so building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "portcullis/v1/objects.proto",
        "portcullis/v1/admin.proto",
        "portcullis/v1/config_stream.proto",
        "portcullis/v1/raft.proto",
        "portcullis/v1/signals.proto",
        "portcullis/v1/placements.proto",
        "portcullis/guardrail/v1/guardrail.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    // Object JSON as `Bytes`: one encoded config version is shared by every proxy it goes to.
    tonic_prost_build::configure()
        .bytes(".portcullis.v1.Object.json")
        .compile_fds(descriptors)?;
    Ok(())
}
