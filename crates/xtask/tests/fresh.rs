//! The committed generated files equal a fresh run of their generator.

use xtask::{Generated, abi, bindings, envdoc, exports, header};

fn assert_current(products: Vec<Generated>) {
    let mut stale = Vec::new();
    for p in products {
        if let Some(reason) = p.check().expect("generated file can be rendered") {
            stale.push(reason);
        }
    }
    assert!(stale.is_empty(), "{}", stale.join("\n"));
}

#[test]
fn bindings_are_current() {
    let paths = match bindings::HeaderPaths::from_env() {
        Ok(p) => p,
        Err(why) => {
            flashcomm_config::testing::skipped(
                "xtask: bindings_are_current",
                &format!("the NCCL or CUDA headers are not available: {why}"),
            );
            return;
        }
    };
    // bindgen panics when it cannot load libclang; that (and only that) is a reason to skip.
    let result = std::panic::catch_unwind(|| bindings::generate(&paths));
    let generated = match result {
        Ok(r) => r.expect("bindgen runs on the pinned headers"),
        Err(payload) => {
            let msg = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            if msg.to_lowercase().contains("libclang") {
                flashcomm_config::testing::skipped(
                    "xtask: bindings_are_current",
                    &format!("libclang is not available: {msg}"),
                );
                return;
            }
            std::panic::resume_unwind(payload);
        }
    };
    assert!(
        generated.functions.len() >= 95,
        "{} functions",
        generated.functions.len()
    );
    assert_current(bindings::outputs(&generated));
}

#[test]
fn forwarders_are_current() {
    assert_current(exports::outputs().unwrap());
}

#[test]
fn support_matrix_is_current() {
    assert_current(abi::outputs().unwrap());
}

#[test]
fn env_table_is_current() {
    assert_current(envdoc::outputs().unwrap());
}

#[test]
fn extension_header_is_current() {
    assert_current(header::outputs().unwrap());
}

#[test]
fn hand_written_and_generated_exports_partition_the_api() {
    let decls = exports::declarations(&exports::read_bindings().unwrap()).unwrap();
    let hand = exports::hand_written().unwrap();
    let forwarded = exports::forwarders().unwrap();
    for d in &decls {
        let name = d.sig.ident.to_string();
        let in_fwd = forwarded.contains(&format!("pub fn {name}("));
        assert!(
            in_fwd != hand.contains(&name),
            "{name}: hand-written {}, forwarded {in_fwd}",
            hand.contains(&name)
        );
    }
    assert_eq!(hand.len(), 39, "{hand:?}");
}

#[test]
fn kernel_headers_are_current() {
    assert_current(xtask::kernels::outputs().expect("kernel headers render"));
}
