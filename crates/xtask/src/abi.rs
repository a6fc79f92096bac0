//! The support matrix of `docs/abi.md`: every public function, what flashcomm does with it, and
//! what it returns when the real library lacks it.

use crate::exports::{declarations, hand_written, read_bindings};
use crate::{Error, Generated, repo_root};
use flashcomm_codec::Collective;

/// Whether `name` is an export of a collective that flashcomm's kernels take when eligible
/// (`FLASHCOMM_OPS`).
fn intercepted(name: &str) -> bool {
    Collective::of_export(name).is_some_and(|k| Collective::KERNELS.contains(&k))
}

/// What each hand-written export does.
fn handling(name: &str) -> Option<&'static str> {
    Some(match name {
        "ncclAllReduce" => {
            "inspected; **intercepted**: flashcomm's lossless or quantized kernels when eligible \
             (inside a group too, launched at the call), else forwarded"
        }
        "ncclAllReduceConfig" => {
            "inspected; forwarded unless `config` is NULL, then as `ncclAllReduce`"
        }
        "ncclReduceScatterConfig" | "ncclAllGatherConfig" | "ncclAlltoAllConfig" => {
            "inspected; forwarded unless `config` is NULL, then as the plain function"
        }
        n if intercepted(n) => {
            "inspected; **intercepted**: flashcomm's lossless kernels when eligible (inside a group \
             too, launched at the call), else forwarded"
        }
        "ncclBroadcast"
        | "ncclBroadcastConfig"
        | "ncclBcast"
        | "ncclReduce"
        | "ncclReduceConfig" => {
            "inspected + forwarded; inside a group that holds its Send/Recv calls back (`FLASHCOMM_GROUPED_ALLTOALL=1`), the held calls go to NCCL first (\"Send/Recv groups\")"
        }
        "ncclSend" | "ncclRecv" => {
            "inspected + forwarded; inside a group with `FLASHCOMM_GROUPED_ALLTOALL=1`, held until the group shows whether it is an all-to-all (\"Send/Recv groups\")"
        }
        "ncclCommInitRank"
        | "ncclCommInitRankConfig"
        | "ncclCommInitAll"
        | "ncclCommInitRankScalable"
        | "ncclCommSplit"
        | "ncclCommGrow" => {
            "forwarded; then the creation hook (**intercepted**: flashcomm's communicator is built)"
        }
        "ncclCommShrink" => {
            "with `NCCL_SHRINK_ABORT`, the parent's flashcomm kernels abort and its routing closes; forwarded; then the creation hook (**intercepted**: flashcomm's communicator is built)"
        }
        "ncclCommFinalize" => {
            "the ending hook (**intercepted**: routing closes, flashcomm's last kernel is waited for); then forwarded"
        }
        "ncclCommRevoke" | "ncclCommAbort" => {
            "the ending hook (**intercepted**: flashcomm's kernels stop); then forwarded"
        }
        "ncclCommSuspend" => {
            "**intercepted**: flashcomm's last kernel is waited for and every call goes to NCCL until a successful resume (flashcomm keeps its memory); then forwarded"
        }
        "ncclCommResume" => {
            "forwarded; **intercepted**: on success flashcomm's kernels take the calls again"
        }
        "ncclCommDestroy" => {
            "the ending hook (**intercepted**: flashcomm's communicator is released); then forwarded"
        }
        "ncclCommRegister" => {
            "forwarded; then, for a communicator flashcomm serves, **intercepted**: the buffer is registered with flashcomm's communicator too (zero-copy for peers of other processes on the peer transport unless `FLASHCOMM_ZERO_COPY=0`); no wait: peers map it at their next direct call"
        }
        "ncclCommWindowRegister" => {
            "forwarded; then, for a communicator flashcomm serves, **intercepted**: the window is registered with flashcomm's communicator too, as with `ncclCommRegister`; outside a group the call then waits, at most 10 s, until every peer of another process that takes part has acknowledged it (`docs/protocols.md`, \"Windows\"); inside a group it does not wait"
        }
        "ncclCommDeregister" | "ncclCommWindowDeregister" => {
            "**intercepted**: flashcomm's communicator stops reading the buffer in place; then forwarded"
        }
        "ncclCommGetAsyncError" => {
            "forwarded; **intercepted**: a device error of flashcomm's kernels is merged in"
        }
        "ncclGroupStart" => {
            "forwarded; group depth tracked (a nested one is held with the calls a holding group holds)"
        }
        "ncclGroupSimulateEnd" => {
            "forwarded; group depth tracked (the group ends; communicators created in it stay with NCCL)"
        }
        "ncclGroupEnd" => {
            "**intercepted** when the group held Send/Recv calls that form an all-to-all (flashcomm's AllToAll runs them; else they go to NCCL in order first); forwarded; group depth tracked; communicators created in the group are set up after it"
        }
        "ncclGetVersion" => "forwarded (reports the real library's version)",
        "ncclGetErrorString" => "ours (NCCL's wording; no real library needed)",
        "ncclGetLastError" => "ours, else the real library's",
        _ => return None,
    })
}

fn when_missing(name: &str, ret: &str) -> String {
    if name == "ncclGetErrorString" || name == "ncclGetLastError" {
        return "n/a (ours)".into();
    }
    if name.ends_with("Config")
        && (intercepted(name) || ["ncclBroadcastConfig", "ncclReduceConfig"].contains(&name))
    {
        return "the plain function if `config` is NULL, else `ncclInvalidUsage`".into();
    }
    match ret {
        "ncclResult_t" => "`ncclInvalidUsage`".into(),
        "" => "nothing happens".into(),
        "::std::os::raw::c_int" => "`-1`".into(),
        "ncclTeam_t" => "the empty team `{0, 0, 0}`".into(),
        other => format!("`{other}`: no default defined"),
    }
}

/// The Markdown table.
pub fn matrix() -> Result<String, Error> {
    let decls = declarations(&read_bindings()?)?;
    let hand = hand_written()?;
    let mut s =
        String::from("| function | handling | when the real library lacks it |\n|---|---|---|\n");
    let mut counts = (0, 0);
    for d in &decls {
        let name = d.sig.ident.to_string();
        let ret = match &d.sig.output {
            syn::ReturnType::Default => String::new(),
            syn::ReturnType::Type(_, t) => {
                let t: &syn::Type = t;
                prettyplease::unparse(&syn::parse_quote!(type T = #t;))
                    .trim()
                    .trim_start_matches("type T = ")
                    .trim_end_matches(';')
                    .to_string()
            }
        };
        let how = if hand.contains(&name) {
            counts.1 += 1;
            handling(&name).ok_or_else(|| {
                Error::new(format!(
                    "{name} is hand-written but xtask/src/abi.rs does not describe it"
                ))
            })?
        } else {
            counts.0 += 1;
            "forwarded"
        };
        let missing = when_missing(&name, &ret);
        if missing.contains("no default defined") {
            return Err(Error::new(format!(
                "{name} returns {ret}: define its default"
            )));
        }
        s.push_str(&format!("| `{name}` | {how} | {missing} |\n"));
    }
    s.push_str(&format!(
        "\n{} functions: {} plain forwarders (generated), {} hand-written. Each is exported as \
         `ncclX` and `pncclX`.\n",
        decls.len(),
        counts.0,
        counts.1
    ));
    Ok(s)
}

/// The generated section of `docs/abi.md`.
pub fn outputs() -> Result<Vec<Generated>, Error> {
    Ok(vec![Generated::section(
        repo_root().join("docs/abi.md"),
        "support-matrix",
        matrix()?,
    )])
}
