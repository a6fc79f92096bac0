//! The set-up exchange of a communicator built from the shim: flashcomm's [`Bootstrap`] (an
//! all-gather of small host buffers) carried by the real NCCL's `ncclAllGather` on the very
//! communicator flashcomm is about to serve.
//!
//! Each round copies this rank's bytes, framed to a fixed length ([`encode_frame`]), into a small
//! device buffer, runs the real `ncclAllGather` (`ncclUint8`) on a stream of our own, waits for it
//! (until it completed or the communicator reports an asynchronous error: no time limit, like
//! NCCL's own init, so no round ever returns with its all-gather still queued), copies the
//! frames back and unpacks them ([`decode_frames`]). Every rank runs the same rounds at the same
//! point (right after the real init returned), so the exchange is collective. A rank whose round
//! fails locally still takes part in the all-gather, with a frame that says so, so that every rank
//! sees the failure and gives up together instead of waiting for it.
//!
//! Owns: [`NcclBootstrap`] and its frame format.
//! May import: `types`, `calls::cuda`, `calls::nccl`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use flashcomm_comm::{Bootstrap, DeviceMem, Error};
use flashcomm_gpu::Device;
use flashcomm_nccl_sys::{ncclComm_t, ncclResult_t};

use crate::calls::cuda::OwnStream;
use crate::calls::nccl;
use crate::types::CommHandle;

/// Bytes of one rank's frame in every round.
pub(crate) const FRAME_BYTES: usize = 4096;
/// Bytes of the frame header: magic, round, status, payload length (four little-endian u32).
const HEADER_BYTES: usize = 16;
/// The largest payload of one round.
pub(crate) const MAX_PAYLOAD: usize = FRAME_BYTES - HEADER_BYTES;
const MAGIC: u32 = 0x5342_4346; // "FCBS"
const STATUS_OK: u32 = 0;
const STATUS_TOO_LONG: u32 = 1;
const STATUS_FAILED: u32 = 2;

/// This rank's frame of round `round`: the header, the payload, zero padding to
/// [`FRAME_BYTES`]. A payload longer than [`MAX_PAYLOAD`] is not sent; the frame says how long it
/// was, and every rank's [`decode_frames`] fails.
pub(crate) fn encode_frame(round: u32, payload: &[u8]) -> Vec<u8> {
    frame(round, payload, false)
}

/// The frame of a rank whose round failed before the exchange (every rank then fails the round).
pub(crate) fn failure_frame(round: u32) -> Vec<u8> {
    frame(round, &[], true)
}

fn frame(round: u32, payload: &[u8], failed: bool) -> Vec<u8> {
    let (status, body) = if failed {
        (STATUS_FAILED, &[][..])
    } else if payload.len() > MAX_PAYLOAD {
        (STATUS_TOO_LONG, &[][..])
    } else {
        (STATUS_OK, payload)
    };
    let len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
    let mut v = Vec::with_capacity(FRAME_BYTES);
    for word in [MAGIC, round, status, len] {
        v.extend_from_slice(&word.to_le_bytes());
    }
    v.extend_from_slice(body);
    v.resize(FRAME_BYTES, 0);
    v
}

/// Unpacks the `nranks` frames of round `round` (rank order, [`FRAME_BYTES`] each). Fails, with
/// the same message on every rank, when any frame is malformed, of another round, too long, or
/// marks a failure.
pub(crate) fn decode_frames(
    round: u32,
    bytes: &[u8],
    nranks: usize,
) -> Result<Vec<Vec<u8>>, String> {
    if bytes.len() != FRAME_BYTES * nranks {
        return Err(format!(
            "received {} bytes for {nranks} frames of {FRAME_BYTES}",
            bytes.len()
        ));
    }
    let mut out = Vec::with_capacity(nranks);
    for (r, f) in bytes.chunks_exact(FRAME_BYTES).enumerate() {
        let word =
            |i: usize| u32::from_le_bytes([f[4 * i], f[4 * i + 1], f[4 * i + 2], f[4 * i + 3]]);
        let (magic, got_round, status, len) = (word(0), word(1), word(2), word(3));
        if magic != MAGIC || got_round != round {
            return Err(format!(
                "rank {r} sent no valid frame for round {round} (its set-up failed, or it runs \
                 another flashcomm version)"
            ));
        }
        match status {
            STATUS_OK if (len as usize) <= MAX_PAYLOAD => {
                out.push(f[HEADER_BYTES..HEADER_BYTES + len as usize].to_vec());
            }
            STATUS_TOO_LONG | STATUS_OK => {
                return Err(format!(
                    "rank {r} had {len} bytes to send, more than a set-up frame holds \
                     ({MAX_PAYLOAD})"
                ));
            }
            STATUS_FAILED => {
                return Err(format!("rank {r} could not take part in round {round}"));
            }
            other => return Err(format!("rank {r} sent a frame with unknown status {other}")),
        }
    }
    Ok(out)
}

struct Rounds {
    next: u32,
}

/// The set-up exchange over the real NCCL (see the module documentation).
pub(crate) struct NcclBootstrap {
    comm: CommHandle,
    rank: u32,
    nranks: u32,
    device: Arc<Device>,
    send: DeviceMem,
    recv: DeviceMem,
    stream: OwnStream,
    rounds: Mutex<Rounds>,
}

impl NcclBootstrap {
    /// The exchange of rank `rank` of `nranks` of the real communicator `comm` on `device`.
    /// Allocates two small device buffers and a stream (freed on drop).
    pub(crate) fn new(
        comm: CommHandle,
        rank: u32,
        nranks: u32,
        device: i32,
    ) -> Result<NcclBootstrap, Error> {
        let dev = Device::open(device)?;
        let _ctx = dev.activate()?;
        let stream = OwnStream::create().map_err(|e| Error::Unsupported(e.to_string()))?;
        let send = DeviceMem::alloc_zeroed(&dev, FRAME_BYTES)?;
        let recv = DeviceMem::alloc_zeroed(&dev, FRAME_BYTES * nranks as usize)?;
        Ok(NcclBootstrap {
            comm,
            rank,
            nranks,
            device: dev,
            send,
            recv,
            stream,
            rounds: Mutex::new(Rounds { next: 0 }),
        })
    }

    fn raw_comm(&self) -> ncclComm_t {
        self.comm.0 as ncclComm_t
    }

    /// Waits until the all-gather on our stream has finished, watching the communicator's
    /// asynchronous error. No time limit: returning while the all-gather is still queued would
    /// leave it to pair with the caller's next NCCL call on a peer that is merely late.
    fn wait(&self) -> Result<(), String> {
        let mut pause = Duration::from_micros(20);
        loop {
            if self.stream.is_idle().map_err(|e| e.to_string())? {
                return Ok(());
            }
            match nccl::async_error(self.raw_comm())? {
                ncclResult_t::ncclSuccess | ncclResult_t::ncclInProgress => {}
                other => {
                    return Err(format!(
                        "the communicator reported error {} during the set-up exchange",
                        other.0
                    ));
                }
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    fn round(&self, round: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let _ctx = self.device.activate()?;
        let stream = self.stream.stream();
        // A local failure still takes part in the all-gather, so that nobody waits for us.
        let local = self.send.upload(0, &encode_frame(round, mine), stream);
        if local.is_err() {
            let _ = self.send.upload(0, &failure_frame(round), stream);
        }
        let r = nccl::all_gather_bytes(
            self.send.addr(),
            self.recv.addr(),
            FRAME_BYTES,
            self.raw_comm(),
            self.stream.raw(),
        )
        .map_err(Error::Bootstrap)?;
        if r != ncclResult_t::ncclSuccess && r != ncclResult_t::ncclInProgress {
            return Err(Error::Bootstrap(format!(
                "the real ncclAllGather of the set-up exchange returned {}",
                r.0
            )));
        }
        self.wait().map_err(Error::Bootstrap)?;
        local?;
        let mut all = vec![0u8; FRAME_BYTES * self.nranks as usize];
        self.recv.download(0, &mut all, stream)?;
        decode_frames(round, &all, self.nranks as usize).map_err(Error::Bootstrap)
    }
}

impl Bootstrap for NcclBootstrap {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.nranks
    }

    fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, Error> {
        let mut rounds = self.rounds.lock().unwrap_or_else(|e| e.into_inner());
        let round = rounds.next;
        rounds.next = rounds.next.wrapping_add(1);
        self.round(round, mine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gather(round: u32, payloads: &[Vec<u8>]) -> Vec<u8> {
        payloads
            .iter()
            .flat_map(|p| encode_frame(round, p))
            .collect()
    }

    #[test]
    fn frames_have_a_fixed_length_with_the_length_in_front() {
        let f = encode_frame(7, b"abc");
        assert_eq!(f.len(), FRAME_BYTES);
        assert_eq!(&f[0..4], &MAGIC.to_le_bytes());
        assert_eq!(&f[4..8], &7u32.to_le_bytes());
        assert_eq!(&f[8..12], &STATUS_OK.to_le_bytes());
        assert_eq!(&f[12..16], &3u32.to_le_bytes());
        assert_eq!(&f[16..19], b"abc");
        assert!(f[19..].iter().all(|&b| b == 0), "zero padding");
        assert_eq!(encode_frame(0, &[]).len(), FRAME_BYTES);
        assert_eq!(encode_frame(0, &[1; MAX_PAYLOAD]).len(), FRAME_BYTES);
    }

    #[test]
    fn frames_round_trip_in_rank_order_with_any_lengths() {
        let payloads = vec![
            vec![],
            vec![1u8; 160],
            vec![2u8; MAX_PAYLOAD],
            b"x".to_vec(),
        ];
        let got = decode_frames(3, &gather(3, &payloads), 4).unwrap();
        assert_eq!(got, payloads);
    }

    #[test]
    fn too_long_payloads_fail_on_every_rank() {
        let payloads = vec![vec![0u8; 4], vec![9u8; MAX_PAYLOAD + 1]];
        let f = encode_frame(0, &payloads[1]);
        assert_eq!(f.len(), FRAME_BYTES);
        assert_eq!(&f[8..12], &STATUS_TOO_LONG.to_le_bytes());
        let e = decode_frames(0, &gather(0, &payloads), 2).unwrap_err();
        assert!(e.contains("rank 1 had 4081 bytes"), "{e}");
    }

    #[test]
    fn failed_stale_and_foreign_frames_fail_the_round() {
        let mut bytes = gather(5, &[b"a".to_vec(), b"b".to_vec()]);
        bytes[FRAME_BYTES..].copy_from_slice(&failure_frame(5));
        let e = decode_frames(5, &bytes, 2).unwrap_err();
        assert!(e.contains("rank 1 could not take part in round 5"), "{e}");

        // A frame left over from an earlier round (a rank that could not write this one).
        let mut bytes = gather(5, &[b"a".to_vec(), b"b".to_vec()]);
        bytes[..FRAME_BYTES].copy_from_slice(&encode_frame(4, b"a"));
        let e = decode_frames(5, &bytes, 2).unwrap_err();
        assert!(e.contains("rank 0 sent no valid frame for round 5"), "{e}");

        // Zeroed memory (nothing was ever written).
        let e = decode_frames(0, &vec![0u8; 2 * FRAME_BYTES], 2).unwrap_err();
        assert!(e.contains("rank 0 sent no valid frame"), "{e}");

        // A length that does not fit, or a wrong total size.
        let mut bytes = gather(1, &[b"a".to_vec()]);
        bytes[12..16].copy_from_slice(&(MAX_PAYLOAD as u32 + 1).to_le_bytes());
        assert!(decode_frames(1, &bytes, 1).is_err());
        assert!(decode_frames(1, &bytes[..FRAME_BYTES - 1], 1).is_err());
    }
}
