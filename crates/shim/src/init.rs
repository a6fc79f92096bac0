//! Lazy initialization: configuration, logging, fork detection, the panic hook.
//!
//! Happens once, at the first call of any export (never in a library constructor). Loading the
//! real library is separate and happens at the first call that needs it (`calls::real`).
//!
//! Owns: [`State`] (the configuration), [`state`], the panic hook and its stash
//! ([`take_panic_text`]), [`debug_panic_point`].
//! May import: `logging`, `calls::os`.

use std::cell::RefCell;

use flashcomm_config::Config;

use crate::calls::os::PerProcess;
use crate::logging::{self, Subsys};

/// What is initialized once per process.
#[derive(Debug)]
pub(crate) struct State {
    /// The configuration, read once.
    pub(crate) config: Config,
}

/// A fork child keeps its parent's (the environment is the same); one its parent was still
/// making when it forked is made again in the child.
static STATE: PerProcess<State> = PerProcess::inherited();

/// The process state, initializing it on first use.
#[inline]
pub(crate) fn state() -> &'static State {
    STATE.get(|| {
        let mut config = Config::from_env();
        let later = logging::install(&mut config);
        if let Err(rc) = crate::calls::os::watch_fork() {
            logging::warn(
                Subsys::Init,
                &format!(
                    "pthread_atfork failed ({rc}); a fork child will take its parent's state for \
                     its own"
                ),
            );
        }
        install_panic_hook();
        report(&config, &later);
        State { config }
    })
}

thread_local! {
    static PANIC_INFO: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Installs the panic hook (once). The cdylib carries its own copy of `std`, so this hook sees
/// only panics of flashcomm's code: it keeps the location and message for the export boundary
/// ([`take_panic_text`]) instead of printing them. In unit tests the host's default hook stays.
fn install_panic_hook() {
    #[cfg(not(test))]
    std::panic::set_hook(Box::new(|info| {
        let text = info.to_string().replace('\n', " ");
        let _ = PANIC_INFO.try_with(|p| {
            if let Ok(mut p) = p.try_borrow_mut() {
                *p = Some(text);
            }
        });
    }));
}

/// The location and message of this thread's last panic, as the hook stashed them.
pub(crate) fn take_panic_text() -> Option<String> {
    PANIC_INFO
        .try_with(|p| p.try_borrow_mut().ok().and_then(|mut p| p.take()))
        .ok()
        .flatten()
}

/// Logs what the configuration found: problems and unknown names at WARN, values that differ
/// from their defaults at INFO, and the pass-through decision.
fn report(config: &Config, later: &[String]) {
    for p in &config.problems {
        logging::warn(Subsys::Env, &p.to_string());
    }
    for msg in later {
        logging::warn(Subsys::Env, msg);
    }
    for name in &config.unknown {
        logging::warn(
            Subsys::Env,
            &format!("{name} is not a flashcomm variable (ignored; see docs/env.md)"),
        );
    }
    let shown: Vec<(&str, String)> = config
        .settings
        .shown()
        .into_iter()
        .chain(config.logging.shown())
        .collect();
    for (name, value) in shown {
        if config.set.contains(&name) {
            logging::info(
                Subsys::Env,
                &format!("{name} set by environment to {value}"),
            );
        }
    }
    if let Some(reason) = &config.passthrough_forced {
        logging::warn(Subsys::Env, reason);
    } else if config.settings.disable {
        logging::info(Subsys::Env, "FLASHCOMM_DISABLE: every call goes to NCCL");
    }
}

/// Panics when `FLASHCOMM_DEBUG_PANIC` names `api` (fault injection for the boundary's tests).
/// Returns the process state it read ([`state`]), which the boundary hands to the exports that
/// need the configuration, so that a call reads it once.
#[inline]
pub(crate) fn debug_panic_point(api: &'static str) -> &'static State {
    let st = state();
    if let Some(name) = &st.config.settings.debug_panic
        && (name.0 == api || name.0.strip_prefix('p') == Some(api))
    {
        panic!("panic injected into {api} by FLASHCOMM_DEBUG_PANIC");
    }
    st
}
