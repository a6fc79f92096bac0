//! Logging: `tracing` events written in NCCL's line format.
//!
//! Lines look like NCCL's, with `FLASHCOMM` where NCCL writes `NCCL`:
//! `host:pid:tid [cudaDev] FLASHCOMM INFO message`, so that the usual grep habits work and our
//! lines are told apart from the real library's. Which lines are written follows `NCCL_DEBUG` and
//! `NCCL_DEBUG_SUBSYS` (each subsystem is the target `flashcomm::<name>`), unless `FLASHCOMM_LOG`
//! gives `tracing` filter directives. Output goes to standard error, `FLASHCOMM_LOG_FILE`, or
//! `NCCL_DEBUG_FILE` + `.flashcomm`. The subscriber is installed once, lazily, and only if no
//! global subscriber exists yet (`try_init` semantics); inside the cdylib this is our own copy of
//! `tracing`, so a host program's subscriber is never replaced. See `docs/logging.md`.
//!
//! Owns: [`Subsys`], [`warn`], [`info`], [`version_banner`], [`install`].
//! May import: `types`, `calls::os`, `calls::cuda`.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::sync::Arc;

use flashcomm_config::{Config, DebugLevel, Subsystems};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

use crate::calls::{cuda, os};
use crate::types::Collective;

/// A subsystem: the `NCCL_DEBUG_SUBSYS` token and the tracing target of its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Subsys {
    /// Loading the real library, communicator creation and destruction.
    Init,
    /// Collectives.
    Coll,
    /// Send and receive.
    P2p,
    /// Configuration.
    Env,
    /// API calls (TRACE: one line per call).
    Call,
}

impl Subsys {
    /// The subsystem of a collective of kind `kind`.
    pub(crate) fn of(kind: Collective) -> Subsys {
        if kind.is_p2p() {
            Subsys::P2p
        } else {
            Subsys::Coll
        }
    }
}

/// Emits one event under `sub`'s target. Targets must be literals, hence the match.
macro_rules! event_at {
    ($level:ident, $sub:expr, $msg:expr) => {
        match $sub {
            Subsys::Init => tracing::$level!(target: "flashcomm::init", "{}", $msg),
            Subsys::Coll => tracing::$level!(target: "flashcomm::coll", "{}", $msg),
            Subsys::P2p => tracing::$level!(target: "flashcomm::p2p", "{}", $msg),
            Subsys::Env => tracing::$level!(target: "flashcomm::env", "{}", $msg),
            Subsys::Call => tracing::$level!(target: "flashcomm::call", "{}", $msg),
        }
    };
}

/// Logs `msg` at WARN under `sub`.
pub(crate) fn warn(sub: Subsys, msg: &str) {
    event_at!(warn, sub, msg);
}

/// Logs `msg` at INFO under `sub`.
pub(crate) fn info(sub: Subsys, msg: &str) {
    event_at!(info, sub, msg);
}

/// Logs the version banner (shown from `NCCL_DEBUG=VERSION` up).
pub(crate) fn version_banner(msg: &str) {
    tracing::info!(target: "flashcomm::version", "{}", msg);
}

/// The filter directives that `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` ask for.
pub(crate) fn directives_from_nccl(
    level: Option<DebugLevel>,
    subsys: Option<&Subsystems>,
) -> String {
    let default_subsys = Subsystems::nccl_default();
    let subsys = subsys.unwrap_or(&default_subsys);
    let verbose = match level {
        None | Some(DebugLevel::Warn) => return "warn".to_string(),
        Some(DebugLevel::None) => return "off".to_string(),
        Some(DebugLevel::Version) => return "warn,flashcomm::version=info".to_string(),
        Some(DebugLevel::Info) | Some(DebugLevel::Abort) => "info",
        Some(DebugLevel::Trace) => "trace",
    };
    let mut d = String::from("warn,flashcomm::version=info");
    let all = subsys.names.iter().any(|n| n == "ALL");
    if subsys.negated {
        if !all {
            let _ = write!(d, ",flashcomm={verbose}");
            for n in &subsys.names {
                let _ = write!(d, ",flashcomm::{}=warn", n.to_ascii_lowercase());
            }
        }
    } else if all {
        let _ = write!(d, ",flashcomm={verbose}");
    } else {
        for n in &subsys.names {
            let _ = write!(d, ",flashcomm::{}={verbose}", n.to_ascii_lowercase());
        }
    }
    d
}

/// Expands `%h` (host name) and `%p` (process id) in a log file name, as NCCL does.
pub(crate) fn expand_file_name(pattern: &str, host: &str, pid: u32) -> String {
    let mut out = String::new();
    let mut chars = pattern.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '%' {
            match chars.peek() {
                Some('h') => {
                    out.push_str(host);
                    chars.next();
                }
                Some('p') => {
                    let _ = write!(out, "{pid}");
                    chars.next();
                }
                _ => out.push('%'),
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Opens the log file `path` for appending without following a link planted at a predictable
/// name (log files often sit in shared folders such as `/tmp`): the last component must not be
/// a symbolic link (`O_NOFOLLOW`) and must be a regular file with no other name (a hard link
/// would let whoever made it choose the file written). `per_process`: the name holds the
/// process id (`%p`), so no other process writes it: it is created new (`O_EXCL`), and a file
/// already there (planted, or left by an earlier process with this id) is refused. Names
/// without `%p` may be shared by every process of a job, so an existing regular file is
/// appended to, as before. Anything else at the name (a FIFO, a device, a socket) is refused, and
/// the open never waits: it is made with `O_NONBLOCK`, since opening a FIFO for writing would
/// otherwise wait for a reader for ever inside the first call of the program.
pub(crate) fn open_log_file(path: &str, per_process: bool) -> Result<std::fs::File, String> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let mut o = OpenOptions::new();
    // O_NONBLOCK: a FIFO without a reader fails at once (ENXIO) instead of blocking. It has no
    // effect on the regular file kept below (writes to regular files never return EAGAIN), so
    // it is left set.
    o.append(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC | libc::O_NONBLOCK);
    if per_process {
        o.create_new(true);
    } else {
        o.create(true);
    }
    let f = o.open(path).map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => "it is a symbolic link (refused)".to_string(),
        Some(libc::ENXIO) => {
            "it is not a regular file (a FIFO or a socket without a reader; refused)".to_string()
        }
        Some(libc::EEXIST) => {
            "it exists already, and its name holds the process id (%p), so no other process \
             should have made it (refused)"
                .to_string()
        }
        _ => e.to_string(),
    })?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    let t = m.file_type();
    if !t.is_file() {
        use std::os::unix::fs::FileTypeExt;
        let what = if t.is_fifo() {
            "a FIFO"
        } else if t.is_char_device() || t.is_block_device() {
            "a device"
        } else if t.is_socket() {
            "a socket"
        } else if t.is_dir() {
            "a directory"
        } else {
            "not a file"
        };
        return Err(format!("it is not a regular file ({what}; refused)"));
    }
    if m.nlink() > 1 {
        return Err(format!("it has {} names (a hard link; refused)", m.nlink()));
    }
    Ok(f)
}

/// [`open_log_file`], with the warning to log when it fails (it names the path).
fn open_or_explain(path: &str, per_process: bool) -> Result<std::fs::File, String> {
    open_log_file(path, per_process)
        .map_err(|e| format!("cannot open log file {path}: {e}; logging to standard error"))
}

/// The host name as NCCL prints it (up to the first dot).
pub(crate) fn host_name() -> String {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let h = h.trim();
    let short = h.split('.').next().unwrap_or_default();
    if short.is_empty() {
        "localhost".to_string()
    } else {
        short.to_string()
    }
}

/// NCCL's line format.
struct NcclFormat {
    host: String,
}

impl<S, N> FormatEvent<S, N> for NcclFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        let level = match *event.metadata().level() {
            Level::ERROR | Level::WARN => "WARN",
            Level::INFO => "INFO",
            Level::DEBUG | Level::TRACE => "TRACE",
        };
        let dev = cuda::current_device().unwrap_or(-1);
        write!(
            writer,
            "{}:{}:{} [{}] FLASHCOMM {} ",
            self.host,
            std::process::id(),
            os::thread_id(),
            dev,
            level
        )?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The variables that show the engagement line whatever `NCCL_DEBUG` says.
const QUANT_VARS: [&str; 3] = [
    "FLASHCOMM_QUANT_BITS",
    "FLASHCOMM_QUANT_RS_BITS",
    "FLASHCOMM_QUANT_AG_BITS",
];

/// The tracing directive of the engagement line and the exit summary.
const ENGAGE_DIRECTIVE: &str = "flashcomm::engage=info";

/// Whether a quantization width was asked for (set, validly or not).
fn quant_asked(config: &Config) -> bool {
    QUANT_VARS
        .iter()
        .any(|v| config.set.contains(v) || config.problems.iter().any(|p| p.variable == *v))
}

/// The directives that `NCCL_DEBUG` asks for (`nccl`), widened to
/// show the engagement line from `NCCL_DEBUG=VERSION` up (where the version banner is shown)
/// and whenever a quantization width is set.
fn engage_directives(nccl: String, config: &Config) -> String {
    if nccl.contains("flashcomm::version=info") || quant_asked(config) {
        format!("{nccl},{ENGAGE_DIRECTIVE}")
    } else {
        nccl
    }
}

/// Installs the subscriber (once per process, by `init`). A `FLASHCOMM_LOG` that does not parse
/// forces pass-through, like any bad `FLASHCOMM_*` value. Returns messages to log at WARN once
/// the subscriber is in place.
pub(crate) fn install(config: &mut Config) -> Vec<String> {
    let mut later = Vec::new();
    let nccl = directives_from_nccl(
        config.logging.nccl_debug,
        config.logging.nccl_debug_subsys.as_ref(),
    );
    let nccl = engage_directives(nccl, config);
    let filter = match &config.logging.log {
        Some(text) => match EnvFilter::builder().parse(&text.0) {
            Ok(f) => f,
            Err(e) => {
                let msg = format!(
                    "FLASHCOMM_LOG={:?} is not valid ({e}); allowed: tracing `EnvFilter` directives",
                    text.0
                );
                later.push(msg.clone());
                config.force_passthrough(format!(
                    "invalid configuration: {msg}; flashcomm forwards every call to NCCL unchanged"
                ));
                EnvFilter::new(&nccl)
            }
        },
        None => EnvFilter::new(&nccl),
    };

    let host = host_name();
    let pid = std::process::id();
    let file = match (&config.logging.log_file, &config.logging.nccl_debug_file) {
        (Some(f), _) => Some((expand_file_name(&f.0, &host, pid), f.0.contains("%p"))),
        (None, Some(f)) => Some((
            format!("{}.flashcomm", expand_file_name(&f.0, &host, pid)),
            f.0.contains("%p"),
        )),
        (None, None) => None,
    };
    let file = file.and_then(
        |(path, per_process)| match open_or_explain(&path, per_process) {
            Ok(f) => Some(Arc::new(f)),
            Err(msg) => {
                later.push(msg);
                None
            }
        },
    );

    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .event_format(NcclFormat { host });
    // Ignore "a global default is already set": a host's subscriber wins (try_init semantics).
    let _ = match file {
        Some(f) => tracing::subscriber::set_global_default(builder.with_writer(f).finish()),
        // Not `std::io::stderr`: its lock, held by a parent's thread at a fork, would stay held
        // in the child.
        None => {
            tracing::subscriber::set_global_default(builder.with_writer(|| os::RawStderr).finish())
        }
    };
    later
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(vars: &[(&str, &str)]) -> Config {
        Config::from_vars(vars.iter().copied())
    }

    #[test]
    fn the_engagement_line_is_shown_from_version_up_and_when_quantizing() {
        let plain = cfg(&[]);
        assert_eq!(engage_directives("warn".into(), &plain), "warn");
        assert_eq!(engage_directives("off".into(), &plain), "off");
        let version = "warn,flashcomm::version=info".to_string();
        assert_eq!(
            engage_directives(version.clone(), &plain),
            format!("{version},flashcomm::engage=info")
        );
        for var in QUANT_VARS {
            for value in ["4", "off", "bogus"] {
                let c = cfg(&[(var, value)]);
                assert_eq!(
                    engage_directives("warn".into(), &c),
                    "warn,flashcomm::engage=info",
                    "{var}={value}"
                );
                // NCCL_DEBUG=NONE too: always when a width is set.
                assert_eq!(
                    engage_directives("off".into(), &c),
                    "off,flashcomm::engage=info"
                );
            }
        }
        // Other variables do not show it.
        assert_eq!(
            engage_directives("warn".into(), &cfg(&[("FLASHCOMM_QUANT_GROUP", "64")])),
            "warn"
        );
        for d in [
            engage_directives("off".into(), &cfg(&[("FLASHCOMM_QUANT_BITS", "4")])),
            engage_directives(version, &plain),
        ] {
            tracing_subscriber::EnvFilter::builder().parse(&d).unwrap();
        }
    }

    use flashcomm_config::Value;

    fn subsys(s: &str) -> Subsystems {
        Subsystems::parse(s).unwrap()
    }

    #[test]
    fn nccl_debug_maps_to_directives() {
        assert_eq!(directives_from_nccl(None, None), "warn");
        assert_eq!(directives_from_nccl(Some(DebugLevel::None), None), "off");
        assert_eq!(directives_from_nccl(Some(DebugLevel::Warn), None), "warn");
        assert_eq!(
            directives_from_nccl(Some(DebugLevel::Version), None),
            "warn,flashcomm::version=info"
        );
        assert_eq!(
            directives_from_nccl(Some(DebugLevel::Info), None),
            "warn,flashcomm::version=info,flashcomm::init=info,flashcomm::bootstrap=info,flashcomm::env=info"
        );
        assert_eq!(
            directives_from_nccl(Some(DebugLevel::Trace), Some(&subsys("COLL,P2P"))),
            "warn,flashcomm::version=info,flashcomm::coll=trace,flashcomm::p2p=trace"
        );
        assert_eq!(
            directives_from_nccl(Some(DebugLevel::Info), Some(&subsys("^COLL"))),
            "warn,flashcomm::version=info,flashcomm=info,flashcomm::coll=warn"
        );
        assert_eq!(
            directives_from_nccl(Some(DebugLevel::Abort), Some(&subsys("ALL"))),
            "warn,flashcomm::version=info,flashcomm=info"
        );
        // Every mapping parses as a filter.
        for d in [
            directives_from_nccl(Some(DebugLevel::Info), Some(&subsys("^COLL,INIT"))),
            directives_from_nccl(Some(DebugLevel::Trace), Some(&subsys("ALL"))),
        ] {
            EnvFilter::builder().parse(&d).unwrap();
        }
    }

    #[test]
    fn file_names_expand() {
        assert_eq!(
            expand_file_name("/tmp/nccl.%h.%p.log", "node1", 42),
            "/tmp/nccl.node1.42.log"
        );
        assert_eq!(expand_file_name("a%%b%x", "h", 1), "a%%b%x");
        assert_eq!(expand_file_name("plain", "h", 1), "plain");
    }

    #[test]
    fn log_files_never_follow_a_planted_link() {
        let dir = std::env::temp_dir().join(format!("flashcomm-logfile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        // A symbolic link at the log file's name, for a shared name and a per-process one.
        for (name, per_process) in [("shared.log", false), ("one.1234.log", true)] {
            let link = dir.join(name);
            std::os::unix::fs::symlink(&victim, &link).unwrap();
            let e = open_log_file(link.to_str().unwrap(), per_process).unwrap_err();
            assert!(e.contains("symbolic link") || e.contains("exists"), "{e}");
        }
        // A hard link to a file of someone else's choosing.
        let hard = dir.join("hard.log");
        std::fs::hard_link(&victim, &hard).unwrap();
        let e = open_log_file(hard.to_str().unwrap(), false).unwrap_err();
        assert!(e.contains("hard link"), "{e}");
        assert_eq!(
            std::fs::read(&victim).unwrap(),
            b"keep",
            "nothing written through a link"
        );
        // A per-process name that exists already is not taken over.
        let planted = dir.join("nccl.99.log.flashcomm");
        std::fs::write(&planted, b"").unwrap();
        assert!(open_log_file(planted.to_str().unwrap(), true).is_err());
        // Ordinary files: created, or appended to when the name is shared.
        use std::io::Write;
        let fresh = dir.join("fresh.77.log");
        writeln!(open_log_file(fresh.to_str().unwrap(), true).unwrap(), "a").unwrap();
        let shared = dir.join("shared2.log");
        for line in ["a", "b"] {
            writeln!(
                open_log_file(shared.to_str().unwrap(), false).unwrap(),
                "{line}"
            )
            .unwrap();
        }
        assert_eq!(std::fs::read_to_string(&shared).unwrap(), "a\nb\n");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A FIFO (named pipe) at a shared log file's name: opening it for writing would wait for a
    /// reader for ever, blocking the first call. It is refused at once, whether or not a reader
    /// has it open, and the warning names the path.
    #[test]
    #[allow(unsafe_code)]
    fn a_fifo_at_the_log_files_name_is_refused_without_blocking() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::OpenOptionsExt;
        let dir = std::env::temp_dir().join(format!("flashcomm-logfifo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("shared.log");
        let c = std::ffi::CString::new(fifo.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let path = fifo.to_str().unwrap().to_string();
        // In a thread with a time limit: before the fix the open never returned.
        let open = |per_process: bool| {
            let (tx, rx) = std::sync::mpsc::channel();
            let p = path.clone();
            std::thread::spawn(move || {
                let _ = tx.send(open_or_explain(&p, per_process).map(|_| ()));
            });
            rx.recv_timeout(std::time::Duration::from_secs(5))
                .expect("opening a FIFO as the log file blocked")
        };
        for per_process in [false, true] {
            let e = open(per_process).unwrap_err();
            assert!(e.contains(&path), "{e}");
            assert!(
                per_process || e.contains("not a regular file"),
                "{per_process}: {e}"
            );
        }
        // With a reader, opening it would succeed: it is refused all the same.
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let e = open(false).unwrap_err();
        assert!(e.contains(&path) && e.contains("not a regular file"), "{e}");
        drop(reader);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn host_name_is_short() {
        let h = host_name();
        assert!(!h.is_empty() && !h.contains('.'));
    }
}
