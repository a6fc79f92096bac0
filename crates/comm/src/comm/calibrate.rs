//! Calibration: the timed collectives at set-up whose agreed result is the cost model the
//! selector plans with.

use std::time::Duration;

use crate::bootstrap::Agreement;
use crate::error::Error;
use crate::gpu::{DeviceMem, Event, Stream};
use crate::plan::{
    self, Algorithm, Choice, Collective, CostModel, DataType, Plan, Protocol, QuantModel,
};

use super::Communicator;
use super::launch::{Run, Work};
use super::setup::verdict;

/// How long a set-up kernel (the calibration's timed collectives) waits for its peers when no
/// timeout is configured: every rank starts them right after the same exchange round, so only a
/// rank that failed to launch keeps its peers waiting, and they must not wait for ever.
pub const SETUP_WAIT: Duration = Duration::from_secs(60);
/// How long the calibration's exchange of its registered buffers waits (a rank that could not
/// make its registration board takes no part: its peers go on staged for it after this long).
const REGISTER_WAIT: Duration = Duration::from_secs(10);

/// The buffers, events and stream the calibration times its plans with.
struct Timers<'a> {
    send: &'a DeviceMem,
    recv: &'a DeviceMem,
    start: &'a Event,
    end: &'a Event,
    stream: Stream,
}

/// `bytes` of bf16 calibration inputs for `rank`: values spread over [-1, 1) in a pattern that
/// differs between ranks and between codec groups, as activations do (an integer hash, so
/// every run times the same data).
fn calibration_inputs(bytes: usize, rank: u32) -> Vec<u8> {
    let mut v = Vec::with_capacity(bytes);
    for i in 0..(bytes / 2) as u32 {
        let h = (i ^ rank.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
        let x = ((h >> 8) as f32 / (1u32 << 24) as f32) * 2.0 - 1.0;
        v.extend_from_slice(&half::bf16::from_f32(x).to_le_bytes());
    }
    v
}

impl Communicator {
    /// Times each (algorithm, protocol) at every size of [`plan::CALIB_SIZES`], then the
    /// quantized AllReduce of every codec setting of `cfg.quant_calibrate`, and agrees on one
    /// model with every rank (the element-wise maximum, so every rank plans alike; one round for
    /// the lossless table, one more for the quantized tables when there are settings to time):
    /// the rounds after set-up step 4. The timed kernels wait at most [`SETUP_WAIT`] (or the
    /// configured timeout, if shorter) for their peers: a rank whose launch failed here cannot
    /// leave its peers' kernels waiting for ever. A failure of any timed kernel, quantized ones
    /// included, fails set-up on every rank (the shim then leaves the communicator to NCCL).
    pub(super) fn calibrate(
        &mut self,
        ag: &mut Agreement<'_>,
        stream: Stream,
        injected: &dyn Fn(u32) -> Result<(), Error>,
    ) -> Result<(), Error> {
        let buf_bytes = *plan::CALIB_SIZES.iter().max().unwrap_or(&(1 << 20)) as usize;
        let buffers = injected(5).and_then(|()| {
            let send = DeviceMem::alloc_zeroed(&self.device, buf_bytes)?;
            let recv = DeviceMem::alloc_zeroed(&self.device, buf_bytes)?;
            // Inputs of varied values, so that the quantized kernels' timed encoding does the
            // work it does on activations (zeros would take its shortest path).
            if !self.cfg.quant_calibrate.is_empty() {
                send.upload(0, &calibration_inputs(buf_bytes, self.rank), stream)?;
            }
            let events = (Event::new(true)?, Event::new(true)?);
            Ok((send, recv, events))
        });
        // Allocation (and its zeroing) must be over on every rank before any rank launches: a
        // rank still clearing its buffers while a peer's kernel already waits for it could be
        // queued behind that kernel when ranks share a GPU.
        ag.check(verdict(buffers.as_ref().map(|_| ())))?;
        let (send, recv, (start, end)) =
            buffers.map_err(|e| Error::Internal(format!("failed set-up step passed: {e}")))?;
        // Zero-copy between processes: the calibration buffers are registered, as a serving
        // stack registers its own, so the direct protocol is timed reading in place. Every rank
        // is here (the round above), so each waits for its peers' mappings (bounded; a rank
        // whose peers were late times its direct plans staged, which the agreed model absorbs).
        let registered = if self.registry.has_boards() && self.arena.direct {
            let _ctx = self.device.activate()?;
            let ids = [send.addr(), recv.addr()]
                .map(|a| self.registry.register(a, buf_bytes as u64, &|| true));
            self.registry.exchange(&ids, REGISTER_WAIT);
            ids.to_vec()
        } else {
            Vec::new()
        };
        let configured = self.cfg.timeout;
        self.cfg.timeout = if configured.is_zero() {
            SETUP_WAIT
        } else {
            configured.min(SETUP_WAIT)
        };
        let timers = Timers {
            send: &send,
            recv: &recv,
            start: &start,
            end: &end,
            stream,
        };
        let began = std::time::Instant::now();
        let measured = self.time_plans(ag, &timers, injected).and_then(|m| {
            let lossless_ms = began.elapsed().as_millis();
            let quant = self.time_quant(ag, &timers)?;
            Ok((m, quant, lossless_ms))
        });
        for id in registered {
            let _ = self.deregister(id);
        }
        self.cfg.timeout = configured;
        // A failure here was agreed in one of the timing rounds: every rank returns it there.
        let (measured, quant, lossless_ms) = measured?;
        let all = ag.round(Ok(measured.to_bytes()))?;
        self.model = CostModel::agree(&all)?;
        tracing::info!(target: "flashcomm::tuning", rank = self.rank, ms = lossless_ms, model = ?self.model, "calibrated cost model");
        if !self.cfg.quant_calibrate.is_empty() {
            let all = ag.round(Ok(QuantModel::to_bytes(&quant)))?;
            self.quant_models = QuantModel::agree(&self.cfg.quant_calibrate, &all)?;
            let ms = began.elapsed().as_millis() - lossless_ms;
            tracing::info!(target: "flashcomm::tuning", rank = self.rank, ms, models = ?self.quant_models, "calibrated quantized AllReduce");
        }
        Ok(())
    }

    /// The timed runs of [`Communicator::calibrate`]: this rank's measured table of the lossless
    /// AllReduce, every (algorithm, protocol) at every size of [`plan::CALIB_SIZES`].
    fn time_plans(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        injected: &dyn Fn(u32) -> Result<(), Error>,
    ) -> Result<CostModel, Error> {
        // A rank that cannot start says so before anything is launched: a launch its peers made
        // would wait for it (and end in their timeout, a different verdict).
        ag.check(verdict(injected(6)))?;
        let mut model = CostModel::default_for(self.nranks);
        // A PULL protocol is timed at the sizes its pull area holds (the same on every rank: the
        // arena is): from the smallest on, up to the first size it cannot serve, from which its
        // row continues as a dropped combination's (plan::Calibration::stop). One that cannot
        // serve the smallest keeps the defaults, which the planner never picks.
        let fits = |algo: Algorithm, proto: Protocol, bytes: u64| {
            let count = bytes / 2;
            let shard = plan::shard_elems(count, self.nranks, 2);
            let two = (algo == Algorithm::TwoShot).then_some(shard).flatten();
            self.arena
                .pull_fits(proto, Collective::AllReduce, count, 2, two)
        };
        let combos: Vec<(Algorithm, Protocol)> = Algorithm::ALL
            .iter()
            .flat_map(|&a| Protocol::ALL.iter().map(move |&p| (a, p)))
            .filter(|&(algo, proto)| fits(algo, proto, plan::CALIB_SIZES[0]))
            .collect();
        let cal = self.time_rows(
            ag,
            t,
            combos.len(),
            |k, bytes| fits(combos[k].0, combos[k].1, bytes),
            |k, bytes| {
                let (algo, proto) = combos[k];
                let p = plan::plan(
                    &self.arena,
                    &self.model,
                    Collective::AllReduce,
                    bytes / 2,
                    2,
                    self.max_grid,
                    Choice::Force(algo),
                    Choice::Force(proto),
                );
                (p, bytes / 2)
            },
        )?;
        for (k, &(algo, proto)) in combos.iter().enumerate() {
            model.set_measured(algo, proto, cal.row(k));
        }
        if self.cfg.calibrate_moves {
            for coll in plan::MOVES {
                self.time_moves(ag, t, coll, &mut model)?;
            }
        }
        Ok(model)
    }

    /// The timed runs of ReduceScatter, AllGather or AllToAll (`coll`) for
    /// `CommConfig::calibrate_moves`: LL, BLOCK and the PULL protocol the communicator offers
    /// (direct where peers read user buffers, else staged) at every whole-buffer size of
    /// [`plan::CALIB_SIZES`], agreed size by size and pruned as the AllReduce's are; recorded as
    /// `coll`'s own rows of `model`.
    fn time_moves(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        coll: Collective,
        model: &mut CostModel,
    ) -> Result<(), Error> {
        let n = u64::from(self.nranks);
        // Elements per rank's piece of a whole buffer of `bytes` (bf16).
        let count_of = |bytes: u64| (bytes / n / 2).max(1);
        let pulled = if self.arena.direct {
            Protocol::Direct
        } else {
            Protocol::Pull
        };
        // As for the AllReduce: a PULL protocol is timed up to the first size its pull area
        // cannot serve (at 3, 5, 6 or 7 ranks the rounded pieces of 16 MiB overflow the default
        // staging half), and its row continues from there.
        let fits =
            |p: Protocol, bytes: u64| self.arena.pull_fits(p, coll, count_of(bytes), 2, None);
        let protos: Vec<Protocol> = [Protocol::Ll, Protocol::Block, pulled]
            .into_iter()
            .filter(|&p| fits(p, plan::CALIB_SIZES[0]))
            .collect();
        let cal = self.time_rows(
            ag,
            t,
            protos.len(),
            |k, bytes| fits(protos[k], bytes),
            |k, bytes| {
                let p = plan::plan(
                    &self.arena,
                    &self.model,
                    coll,
                    count_of(bytes),
                    2,
                    self.max_grid,
                    Choice::Auto,
                    Choice::Force(protos[k]),
                );
                (p, count_of(bytes))
            },
        )?;
        for (k, &proto) in protos.iter().enumerate() {
            model.set_move_measured(coll, proto, cal.row(k));
        }
        Ok(())
    }

    /// Times `n` combinations at every size of [`plan::CALIB_SIZES`], size by size: combination
    /// `k` runs `plan_of(k, bytes)` (its plan and element count at a size) while it is in the
    /// running, stops at the first size `fits(k, bytes)` says it cannot serve
    /// ([`plan::Calibration::stop`]), and the times of a size are agreed (the element-wise
    /// maximum) before the next, so that every rank drops the same combinations.
    fn time_rows(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        n: usize,
        fits: impl Fn(usize, u64) -> bool,
        plan_of: impl Fn(usize, u64) -> (Plan, u64),
    ) -> Result<plan::Calibration, Error> {
        let mut cal = plan::Calibration::new(n);
        for (i, &bytes) in plan::CALIB_SIZES.iter().enumerate() {
            let mut times = vec![0f64; n];
            for (k, time) in times.iter_mut().enumerate() {
                if cal.live(k) && !fits(k, bytes) {
                    cal.stop(k, i);
                }
                if !cal.live(k) {
                    continue;
                }
                let (p, count) = plan_of(k, bytes);
                *time = self.time_plan(ag, t, &p, count)?;
            }
            let all = ag.round(Ok(times.iter().flat_map(|t| t.to_le_bytes()).collect()))?;
            let agreed = plan::Calibration::agree_times(&all, n)?;
            cal.record(i, &agreed);
        }
        Ok(cal)
    }

    /// The timed runs of the quantized AllReduce for every codec setting of
    /// `cfg.quant_calibrate` (in that order): each algorithm at every size of
    /// [`plan::CALIB_SIZES`] where the planner may choose it (two-step from
    /// [`plan::QUANT_TWO_STEP_MIN_BLOCKS`] codec blocks and at least one per rank; 0 elsewhere).
    /// A setting without kernels is left unmeasured (its calls go to NCCL).
    fn time_quant(&self, ag: &mut Agreement<'_>, t: &Timers<'_>) -> Result<Vec<QuantModel>, Error> {
        let mut models = Vec::with_capacity(self.cfg.quant_calibrate.len());
        for &spec in &self.cfg.quant_calibrate {
            let mut m = QuantModel {
                spec,
                table_us: [[0.0; plan::CALIB_SIZES.len()]; 2],
            };
            if spec.has_kernels() {
                for algo in Algorithm::ALL {
                    for (i, &bytes) in plan::CALIB_SIZES.iter().enumerate() {
                        let count = bytes / 2;
                        let blocks = count.div_ceil(plan::CODEC_BLOCK_VALUES);
                        if algo == Algorithm::TwoShot
                            && blocks < plan::QUANT_TWO_STEP_MIN_BLOCKS.max(self.nranks.into())
                        {
                            continue;
                        }
                        let p = plan::plan_quant(
                            &self.arena,
                            &self.model,
                            None,
                            count,
                            DataType::Bf16,
                            spec,
                            self.max_grid,
                            Choice::Force(algo),
                        )?;
                        m.table_us[algo.index()][i] = self.time_plan(ag, t, &p, count)?;
                    }
                }
            }
            models.push(m);
        }
        Ok(models)
    }

    /// Times one plan of a bf16 collective of `count` values (per rank's piece, for the
    /// collectives other than AllReduce) for calibration, in microseconds per call. The plan is timed as a CUDA graph of `reps` calls, as decode loops run them (eager
    /// launches would measure the host's launch spread across ranks, not the plan), between three
    /// checked rounds: instantiation and destruction happen only while every rank is idle (with
    /// ranks sharing a GPU they can wait for running kernels), and a rank whose step failed says
    /// so in the next round, where every rank stops.
    fn time_plan(
        &self,
        ag: &mut Agreement<'_>,
        t: &Timers<'_>,
        p: &Plan,
        count: u64,
    ) -> Result<f64, Error> {
        let stream = t.stream;
        let launch = || {
            let l = self.launch_of(
                p,
                t.send.as_ptr(),
                t.recv.as_ptr(),
                count,
                2,
                Some(DataType::Bf16),
                None,
            )?;
            self.enqueue(Work::only(Run::Kernel(l)), stream)
        };
        // Warm-up, then every rank is idle.
        let warm = (|| {
            launch()?;
            launch()?;
            stream.synchronize()?;
            self.check_status()
        })();
        ag.check(verdict(warm))?;
        // Large messages need fewer calls to time well (and calibration stays short).
        let reps = if count * 2 > 1 << 20 { 4 } else { 16 };
        let graph = (|| {
            stream.begin_capture()?;
            let mut captured = Ok(());
            for _ in 0..reps {
                captured = launch();
                if captured.is_err() {
                    break;
                }
            }
            let graph = stream.end_capture();
            captured?;
            Ok::<_, Error>(graph?)
        })();
        ag.check(verdict(graph.as_ref().map(|_| ())))?;
        let graph = graph.map_err(|e| Error::Internal(format!("failed step passed: {e}")))?;
        // The fastest of a few replays: calibration should see what the plan costs, not the
        // noise of one replay, so that two calibrations agree.
        let timed = (|| {
            graph.launch(stream)?;
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                t.start.record(stream)?;
                graph.launch(stream)?;
                t.end.record(stream)?;
                t.end.synchronize()?;
                self.check_status()?;
                best = best.min(t.end.elapsed_ms_since(t.start)? as f64 * 1000.0 / reps as f64);
            }
            stream.synchronize()?;
            Ok::<_, Error>(best)
        })();
        ag.check(verdict(timed.as_ref().map(|_| ())))?;
        drop(graph);
        timed.map_err(|e| Error::Internal(format!("failed step passed: {e}")))
    }
}
