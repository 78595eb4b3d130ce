//! Compiles the .proto files with a vendored protoc, so builds need no system protobuf install.

use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "google/rpc/status.proto",
    "allot/v1/raft.proto",
    "allot/v1/allocator.proto",
    "allot/v1/agent.proto",
    "envoy/config/core/v3/base.proto",
    "envoy/type/v3/ratelimit_unit.proto",
    "envoy/extensions/common/ratelimit/v3/ratelimit.proto",
    "envoy/service/ratelimit/v3/rls.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // The build script is single-threaded at this point, so setting the variable is race-free.
    std::env::set_var("PROTOC", protoc);
    // The vendored include dir carries google/protobuf/*.proto (wrappers, duration, struct...).
    let well_known = protoc_bin_vendored::include_path()?;

    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={}", root.join(proto).display());
    }

    let protos: Vec<PathBuf> = PROTOS.iter().map(|p| root.join(p)).collect();
    let includes = [root.clone(), well_known];
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&protos, &includes)?;
    Ok(())
}
