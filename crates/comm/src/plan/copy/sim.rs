//! A CPU simulator of the copy-engine schedule: every rank's streams executed in random
//! interleavings, side by side or serialized into one queue per rank in a random order that
//! respects the events, over a byte-level model of device, staging and flag memory. It checks
//! the exact result (sums in rank order), that no order deadlocks, that no staging byte is
//! overwritten before every reader has read it and that no staging byte is read before it was
//! written for the reader.

use super::*;
use flashcomm_codec::rng::Rng;

/// How a rank's two streams run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Two queues per rank, interleaved at random.
    SideBySide,
    /// One queue per rank: a random order of both streams that respects every event.
    Serialized,
}

/// A change made to every rank's schedule before it runs (the mutation tests).
type Mutation = dyn Fn(&CopyGeom, &mut Vec<(Lane, Op)>);

/// One operation of a queue: the call it belongs to and the operation.
type Item = (usize, Op);

struct Call {
    inputs: Vec<Vec<u8>>,
    outputs: Vec<Vec<u8>>,
    in_place: bool,
}

struct World {
    n: usize,
    slot_bytes: usize,
    calls: Vec<Call>,
    gather: Vec<Vec<u8>>,
    stage: Vec<Vec<u8>>,
    /// Per staging byte: the ranks that must still read it (bit per rank).
    pending: Vec<Vec<u64>>,
    flags: Vec<u32>,
}

impl World {
    fn read(&mut self, rank: usize, call: usize, s: Span) -> Result<Vec<u8>, String> {
        let c = &self.calls[call];
        Ok(match s.mem {
            Mem::Input => c.inputs[rank][s.offset..s.offset + s.len].to_vec(),
            Mem::Output if c.in_place => c.inputs[rank][s.offset..s.offset + s.len].to_vec(),
            Mem::Output => c.outputs[rank][s.offset..s.offset + s.len].to_vec(),
            Mem::Gather => self.gather[rank][s.offset..s.offset + s.len].to_vec(),
            Mem::Stage { owner } => {
                for b in s.offset..s.offset + s.len {
                    let m = &mut self.pending[owner][b];
                    if *m & (1 << rank) == 0 {
                        return Err(format!(
                            "rank {rank} read staging byte {b} of rank {owner} not written for it"
                        ));
                    }
                    *m &= !(1 << rank);
                }
                self.stage[owner][s.offset..s.offset + s.len].to_vec()
            }
        })
    }

    fn write(&mut self, rank: usize, call: usize, s: Span, data: &[u8]) -> Result<(), String> {
        let n = self.n;
        let c = &mut self.calls[call];
        let dst = match s.mem {
            Mem::Input => return Err("a write to the input".into()),
            Mem::Output if c.in_place => &mut c.inputs[rank],
            Mem::Output => &mut c.outputs[rank],
            Mem::Gather => &mut self.gather[rank],
            Mem::Stage { owner } => {
                if owner != rank {
                    return Err(format!("rank {rank} wrote rank {owner}'s staging"));
                }
                let slot = (s.offset / self.slot_bytes) % n;
                let readers: u64 = if slot == owner {
                    ((1u64 << n) - 1) & !(1 << owner)
                } else {
                    1 << slot
                };
                for b in s.offset..s.offset + s.len {
                    let m = &mut self.pending[owner][b];
                    if *m != 0 {
                        return Err(format!(
                            "rank {rank} overwrote staging byte {b} before readers {m:#b} read it"
                        ));
                    }
                    *m = readers;
                }
                &mut self.stage[owner]
            }
        };
        dst[s.offset..s.offset + s.len].copy_from_slice(data);
        Ok(())
    }
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Where each queue's `WaitEvent` is satisfied: (queue, index) of the record it waits for.
struct Queue {
    items: Vec<Item>,
    /// For a WaitEvent at index i: the queue and index of its record (side by side).
    dep: Vec<Option<(usize, usize)>>,
    pc: usize,
}

/// Builds every rank's queues for the calls (host order of the ops: the order of `ops`).
fn queues(per_rank: &[Vec<(usize, Lane, Op)>], mode: Mode, rng: &mut Rng) -> Vec<Vec<Queue>> {
    per_rank
        .iter()
        .map(|ops| {
            // Lanes as queues, events resolved to the latest record enqueued before the wait.
            let mut lanes: [Vec<Item>; 2] = [Vec::new(), Vec::new()];
            let mut deps: [Vec<Option<(usize, usize)>>; 2] = [Vec::new(), Vec::new()];
            let mut last: std::collections::HashMap<usize, (usize, usize)> = Default::default();
            for (call, lane, op) in ops {
                let l = match lane {
                    Lane::Push => 0,
                    Lane::Pull => 1,
                };
                let dep = match op {
                    Op::Record { event } => {
                        last.insert(*event, (l, lanes[l].len()));
                        None
                    }
                    Op::WaitEvent { event } => Some(*last.get(event).expect("wait before record")),
                    _ => None,
                };
                lanes[l].push((*call, op.clone()));
                deps[l].push(dep);
            }
            match mode {
                Mode::SideBySide => lanes
                    .into_iter()
                    .zip(deps)
                    .map(|(items, dep)| Queue { items, dep, pc: 0 })
                    .collect(),
                Mode::Serialized => {
                    // A random linear extension: take either lane's head when its event (if any)
                    // is already taken.
                    let mut pcs = [0usize; 2];
                    let mut items = Vec::new();
                    while pcs[0] < lanes[0].len() || pcs[1] < lanes[1].len() {
                        let ok = |l: usize, pcs: &[usize; 2]| {
                            pcs[l] < lanes[l].len()
                                && deps[l][pcs[l]].is_none_or(|(dl, di)| pcs[dl] > di)
                        };
                        let cand: Vec<usize> = (0..2).filter(|&l| ok(l, &pcs)).collect();
                        assert!(!cand.is_empty(), "the events of a rank form a cycle");
                        let l = cand[rng.below(cand.len())];
                        items.push(lanes[l][pcs[l]].clone());
                        pcs[l] += 1;
                    }
                    let dep = vec![None; items.len()];
                    vec![Queue { items, dep, pc: 0 }]
                }
            }
        })
        .collect()
}

struct Case {
    n: usize,
    /// Elements per call.
    counts: Vec<usize>,
    piece_bytes: usize,
    first_piece: u32,
    in_place: bool,
}

/// Runs the calls of `case` with every rank's schedule passed through `mutate`; returns the
/// first violation, deadlock or wrong result.
fn run(case: &Case, mode: Mode, seed: u64, mutate: &Mutation) -> Result<(), String> {
    let n = case.n;
    let mut rng = Rng::new(seed);
    let mut per_rank: Vec<Vec<(usize, Lane, Op)>> = vec![Vec::new(); n];
    let mut calls = Vec::new();
    let mut slot_bytes = 0;
    let mut first = case.first_piece;
    let mut expected = Vec::new();
    for (ci, &count) in case.counts.iter().enumerate() {
        let mut next = first;
        for (r, ops) in per_rank.iter_mut().enumerate() {
            let geom = CopyGeom::new(n, r, 4, count, case.piece_bytes, first);
            slot_bytes = geom.slot_bytes();
            let mut s = schedule(&geom);
            mutate(&geom, &mut s);
            ops.extend(s.into_iter().map(|(l, o)| (ci, l, o)));
            next = geom.next_piece();
        }
        first = next;
        let inputs: Vec<Vec<u8>> = (0..n)
            .map(|_| {
                (0..count)
                    .flat_map(|_| {
                        let x = (rng.signed_unit() * 1000.0) as f32 * (1.0 + rng.uniform() as f32);
                        x.to_le_bytes()
                    })
                    .collect()
            })
            .collect();
        let want: Vec<f32> = (0..count)
            .map(|e| {
                let mut acc = f32s(&inputs[0][e * 4..e * 4 + 4])[0];
                for inp in &inputs[1..] {
                    acc += f32s(&inp[e * 4..e * 4 + 4])[0];
                }
                acc
            })
            .collect();
        expected.push(want);
        calls.push(Call {
            outputs: vec![vec![0xA5; count * 4]; n],
            inputs,
            in_place: case.in_place,
        });
    }
    let mut w = World {
        n,
        slot_bytes,
        calls,
        gather: vec![vec![0; n * slot_bytes]; n],
        stage: vec![vec![0; 2 * n * slot_bytes]; n],
        pending: vec![vec![0; 2 * n * slot_bytes]; n],
        // As if the communicator had run `first_piece` pieces before.
        flags: vec![case.first_piece; flag_words(n)],
    };
    let mut qs = queues(&per_rank, mode, &mut rng);
    loop {
        let mut ready = Vec::new();
        let mut left = false;
        for (r, rq) in qs.iter().enumerate() {
            for (qi, q) in rq.iter().enumerate() {
                if q.pc >= q.items.len() {
                    continue;
                }
                left = true;
                let ok = match &q.items[q.pc].1 {
                    Op::Wait { flag, value } => flag_reached(w.flags[flag.index(n)], *value),
                    Op::WaitEvent { .. } => q.dep[q.pc].is_none_or(|(dl, di)| rq[dl].pc > di),
                    _ => true,
                };
                if ok {
                    ready.push((r, qi));
                }
            }
        }
        if !left {
            break;
        }
        if ready.is_empty() {
            let heads: Vec<String> = qs
                .iter()
                .enumerate()
                .flat_map(|(r, rq)| {
                    rq.iter()
                        .filter(|q| q.pc < q.items.len())
                        .map(move |q| format!("rank {r}: {:?}", q.items[q.pc].1))
                })
                .collect();
            return Err(format!("deadlock: {heads:?}"));
        }
        let (r, qi) = ready[rng.below(ready.len())];
        let (call, op) = qs[r][qi].items[qs[r][qi].pc].clone();
        qs[r][qi].pc += 1;
        match op {
            Op::Copy { src, dst } => {
                if src.len != dst.len {
                    return Err(format!("copy of {} bytes into {}", src.len, dst.len));
                }
                let d = w
                    .read(r, call, src)
                    .map_err(|e| format!("{e} (call {call}, {src:?} -> {dst:?})"))?;
                w.write(r, call, dst, &d)?;
            }
            Op::Signal { flag, value } => w.flags[flag.index(n)] = value,
            Op::Reduce { srcs, dst, elems } => {
                let mut acc = f32s(&w.read(r, call, srcs[0])?);
                for s in &srcs[1..] {
                    for (a, x) in acc.iter_mut().zip(f32s(&w.read(r, call, *s)?)) {
                        *a += x;
                    }
                }
                if acc.len() != elems {
                    return Err("reduce length".into());
                }
                let b: Vec<u8> = acc.iter().flat_map(|x| x.to_le_bytes()).collect();
                w.write(r, call, dst, &b)?;
            }
            Op::Wait { .. } | Op::Record { .. } | Op::WaitEvent { .. } => {}
        }
    }
    for (ci, want) in expected.iter().enumerate() {
        let c = &w.calls[ci];
        for r in 0..n {
            let got = f32s(if c.in_place {
                &c.inputs[r]
            } else {
                &c.outputs[r]
            });
            for (e, (g, x)) in got.iter().zip(want).enumerate() {
                if g.to_bits() != x.to_bits() {
                    return Err(format!("call {ci} rank {r} element {e}: {g} != {x}"));
                }
            }
        }
    }
    // Every staged byte was read by everyone it was written for.
    for (o, p) in w.pending.iter().enumerate() {
        if let Some(b) = p.iter().position(|&m| m != 0) {
            return Err(format!(
                "staging byte {b} of rank {o} never read by {:#b}",
                p[b]
            ));
        }
    }
    Ok(())
}

fn keep(_: &CopyGeom, _: &mut Vec<(Lane, Op)>) {}

fn cases() -> Vec<Case> {
    let mut v = Vec::new();
    for n in [2, 3, 4, 8] {
        for in_place in [false, true] {
            // Several pieces, the last one short; sizes that split unevenly into chunks.
            v.push(Case {
                n,
                counts: vec![n * 64 * 5 + 7, 3, n * 64 * 2],
                piece_bytes: n * 64 * 4,
                first_piece: 0,
                in_place,
            });
            // A piece counter about to wrap.
            v.push(Case {
                n,
                counts: vec![n * 16 * 3 + 1, n * 16 * 4 - 1],
                piece_bytes: n * 16 * 4,
                first_piece: u32::MAX - 3,
                in_place,
            });
        }
    }
    v
}

#[test]
fn exact_and_deadlock_free_in_random_orders() {
    for (i, case) in cases().iter().enumerate() {
        for mode in [Mode::SideBySide, Mode::Serialized] {
            let seeds = if case.n == 8 { 4 } else { 24 };
            for seed in 0..seeds {
                if let Err(e) = run(case, mode, seed * 1000 + i as u64, &keep) {
                    panic!(
                        "n={} in_place={} {mode:?} seed {seed}: {e}",
                        case.n, case.in_place
                    );
                }
            }
        }
    }
}

#[test]
fn one_piece_and_tiny_calls() {
    for n in [2, 3, 4, 8] {
        for count in [1, n - 1, n, n + 1, 4 * n] {
            let case = Case {
                n,
                counts: vec![count, count],
                piece_bytes: 4096,
                first_piece: 7,
                in_place: count % 2 == 0,
            };
            for mode in [Mode::SideBySide, Mode::Serialized] {
                for seed in 0..10 {
                    run(&case, mode, seed, &keep).unwrap();
                }
            }
        }
    }
}

/// Runs `mutate` on many seeds of both modes; true when some run fails.
fn caught(mutate: &Mutation, modes: &[Mode]) -> bool {
    for n in [2, 3, 4] {
        for in_place in [false, true] {
            let case = Case {
                n,
                counts: vec![n * 64 * 6 + 3, n * 64 * 3],
                piece_bytes: n * 64 * 2,
                first_piece: 0,
                in_place,
            };
            for &mode in modes {
                for seed in 0..60 {
                    if run(&case, mode, seed, mutate).is_err() {
                        return true;
                    }
                }
            }
        }
    }
    false
}

fn drop_where(s: &mut Vec<(Lane, Op)>, pred: &dyn Fn(&Lane, &Op) -> bool) {
    let before = s.len();
    s.retain(|(l, o)| !pred(l, o));
    assert!(s.len() < before, "the mutation removed nothing");
}

#[test]
fn mutation_with_one_staging_half_fails() {
    // Every piece in half 0: a rank overwrites what a slower peer has not read yet.
    let m = |g: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        for (_, o) in s.iter_mut() {
            if let Op::Copy { src, dst } = o {
                for sp in [src, dst] {
                    if matches!(sp.mem, Mem::Stage { .. }) {
                        sp.offset %= g.nranks * g.slot_bytes();
                    }
                }
            }
        }
    };
    assert!(caught(&m, &[Mode::SideBySide, Mode::Serialized]));
}

#[test]
fn mutation_without_reduce_scatter_wait_fails() {
    let m = |_: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        drop_where(s, &|_, o| {
            matches!(
                o,
                Op::Wait {
                    flag: Flag::Rs { .. },
                    ..
                }
            )
        })
    };
    assert!(caught(&m, &[Mode::SideBySide]));
}

#[test]
fn mutation_without_all_gather_wait_fails() {
    let m = |_: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        drop_where(s, &|_, o| {
            matches!(
                o,
                Op::Wait {
                    flag: Flag::Ag { .. },
                    ..
                }
            )
        })
    };
    assert!(caught(&m, &[Mode::SideBySide]));
}

#[test]
fn mutation_without_reduction_event_fails() {
    let m = |_: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        let e = event_count_of(s) - 2;
        drop_where(s, &|l, o| {
            *l == Lane::Push && *o == Op::WaitEvent { event: e }
        })
    };
    assert!(caught(&m, &[Mode::SideBySide]));
}

/// The event count of a schedule: one more than its largest id.
fn event_count_of(s: &[(Lane, Op)]) -> usize {
    s.iter()
        .filter_map(|(_, o)| match o {
            Op::Record { event } => Some(*event + 1),
            _ => None,
        })
        .max()
        .unwrap()
}

#[test]
fn mutation_without_own_push_event_deadlocks_serialized() {
    // The pull stream's wait for a peer's reduce-scatter push comes after the rank's own push of
    // the same step; without that event a serialized rank can wait before it pushed, and two
    // such ranks wait for each other.
    let m = |_: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        let ag = event_count_of(s) - 1;
        let red = ag - 1;
        drop_where(s, &|l, o| {
            *l == Lane::Pull && matches!(o, Op::WaitEvent { event } if *event < red)
        })
    };
    let mut deadlocked = false;
    'outer: for n in [2, 3, 4] {
        let case = Case {
            n,
            counts: vec![n * 64 * 4],
            piece_bytes: n * 64 * 2,
            first_piece: 0,
            in_place: false,
        };
        for seed in 0..200 {
            if let Err(e) = run(&case, Mode::Serialized, seed, &m) {
                assert!(e.starts_with("deadlock"), "{e}");
                deadlocked = true;
                break 'outer;
            }
        }
    }
    assert!(deadlocked);
}

#[test]
fn mutation_without_in_place_event_fails() {
    // In place, the output's chunk q is the input's chunk q: the all-gather pull may overwrite
    // it only after the rank pushed it (the all-gather event).
    let m = |_: &CopyGeom, s: &mut Vec<(Lane, Op)>| {
        let ag = event_count_of(s) - 1;
        drop_where(s, &|l, o| {
            *l == Lane::Pull && *o == Op::WaitEvent { event: ag }
        })
    };
    assert!(caught(&m, &[Mode::SideBySide, Mode::Serialized]));
}

#[test]
fn waited_flags_cover_every_wait() {
    for n in [2, 3, 4, 8] {
        for r in 0..n {
            let g = CopyGeom::new(n, r, 4, 1000, 256, 5);
            let w = waited_flags(n, r);
            for (_, o) in schedule(&g) {
                if let Op::Wait { flag, .. } = o {
                    assert!(w.contains(&flag), "{flag:?}");
                }
                if let Op::Signal { flag, .. } = o {
                    assert!(flag.index(n) < flag_words(n));
                }
            }
        }
    }
}

/// An operation at the level of device addresses, as [`execute`] hands it to an engine.
#[derive(Clone, Debug)]
enum AOp {
    Copy(u64, u64, usize),
    Wait(u64, u32),
    Signal(u64, u32),
    Record(usize),
    WaitEvent(usize),
    Reduce(Vec<u64>, u64, usize),
}

/// Per lane, where each event wait's record is (lane, index).
type Deps = [Vec<Option<(usize, usize)>>; 2];

/// An engine that only records what it is asked to do.
#[derive(Default)]
struct Recorder(Vec<(Lane, AOp)>);

impl Engine for Recorder {
    type Error = String;
    fn copy(&mut self, l: Lane, dst: u64, src: u64, n: usize) -> Result<(), String> {
        self.0.push((l, AOp::Copy(dst, src, n)));
        Ok(())
    }
    fn wait(&mut self, l: Lane, a: u64, v: u32) -> Result<(), String> {
        self.0.push((l, AOp::Wait(a, v)));
        Ok(())
    }
    fn signal(&mut self, l: Lane, a: u64, v: u32) -> Result<(), String> {
        self.0.push((l, AOp::Signal(a, v)));
        Ok(())
    }
    fn record(&mut self, l: Lane, e: usize) -> Result<(), String> {
        self.0.push((l, AOp::Record(e)));
        Ok(())
    }
    fn wait_event(&mut self, l: Lane, e: usize) -> Result<(), String> {
        self.0.push((l, AOp::WaitEvent(e)));
        Ok(())
    }
    fn reduce(&mut self, l: Lane, s: &[u64], d: u64, n: usize) -> Result<(), String> {
        self.0.push((l, AOp::Reduce(s.to_vec(), d, n)));
        Ok(())
    }
}

/// A flat address space of separate allocations; every access must fall inside one.
struct Space(Vec<(u64, Vec<u8>)>);

impl Space {
    fn find(&mut self, a: u64, n: usize) -> &mut [u8] {
        for (base, m) in self.0.iter_mut() {
            if a >= *base && a + n as u64 <= *base + m.len() as u64 {
                let o = (a - *base) as usize;
                return &mut m[o..o + n];
            }
        }
        panic!("access of {n} bytes at {a:#x} outside every allocation");
    }
    fn word(&mut self, a: u64) -> u32 {
        assert_eq!(a % 4, 0, "unaligned flag");
        u32::from_le_bytes(self.find(a, 4).try_into().unwrap())
    }
}

/// The schedule through [`execute`] and [`CopyAddrs`], run on a flat address space with random
/// interleavings of every rank's two streams: the addresses keep the result exact and in bounds.
#[test]
fn executed_at_addresses_is_exact() {
    for n in [2, 3, 4, 8] {
        for in_place in [false, true] {
            for seed in 0..(if n == 8 { 1 } else { 3 }) {
                let mut rng = Rng::new(seed + 100 * n as u64);
                let count = n * 100 + 13;
                let (piece_bytes, first) = (n * 64, 5u32);
                let g0 = CopyGeom::new(n, 0, 4, count, piece_bytes, first);
                let mut space = Space(Vec::new());
                let base = |r: usize, k: u64| 0x1_0000_0000 * (r as u64 + 1) + 0x1000_0000 * k;
                let mut inputs = Vec::new();
                for r in 0..n {
                    let inp: Vec<u8> = (0..count)
                        .flat_map(|_| ((rng.signed_unit() * 100.0) as f32).to_le_bytes())
                        .collect();
                    inputs.push(inp.clone());
                    space.0.push((base(r, 0), inp));
                    if !in_place {
                        space.0.push((base(r, 1), vec![0; count * 4]));
                    }
                    space.0.push((base(r, 2), vec![0; g0.gather_bytes()]));
                    let mut area = vec![0u8; copy_area_bytes(&g0)];
                    for w in 0..n + 1 {
                        area[4 * w..4 * w + 4].copy_from_slice(&first.to_le_bytes());
                    }
                    space.0.push((base(r, 3), area));
                }
                let areas: Vec<u64> = (0..n).map(|r| base(r, 3)).collect();
                let mut lanes: Vec<[Vec<AOp>; 2]> = Vec::new();
                let mut deps: Vec<Deps> = Vec::new();
                for r in 0..n {
                    let geom = CopyGeom::new(n, r, 4, count, piece_bytes, first);
                    let addrs = CopyAddrs {
                        input: base(r, 0),
                        output: base(r, if in_place { 0 } else { 1 }),
                        gather: base(r, 2),
                        areas: areas.clone(),
                    };
                    let mut rec = Recorder::default();
                    execute(&schedule(&geom), &addrs, &mut rec).unwrap();
                    let mut l2: [Vec<AOp>; 2] = [Vec::new(), Vec::new()];
                    let mut d2: Deps = [Vec::new(), Vec::new()];
                    let mut last = std::collections::HashMap::new();
                    for (lane, op) in rec.0 {
                        let l = (lane == Lane::Pull) as usize;
                        let dep = match op {
                            AOp::Record(e) => {
                                last.insert(e, (l, l2[l].len()));
                                None
                            }
                            AOp::WaitEvent(e) => Some(last[&e]),
                            _ => None,
                        };
                        l2[l].push(op);
                        d2[l].push(dep);
                    }
                    lanes.push(l2);
                    deps.push(d2);
                }
                let mut pcs = vec![[0usize; 2]; n];
                loop {
                    let mut ready = Vec::new();
                    let mut left = false;
                    for r in 0..n {
                        for l in 0..2 {
                            let pc = pcs[r][l];
                            if pc >= lanes[r][l].len() {
                                continue;
                            }
                            left = true;
                            let ok = match &lanes[r][l][pc] {
                                AOp::Wait(a, v) => flag_reached(space.word(*a), *v),
                                AOp::WaitEvent(_) => {
                                    let (dl, di) = deps[r][l][pc].unwrap();
                                    pcs[r][dl] > di
                                }
                                _ => true,
                            };
                            if ok {
                                ready.push((r, l));
                            }
                        }
                    }
                    if !left {
                        break;
                    }
                    assert!(!ready.is_empty(), "deadlock at addresses");
                    let (r, l) = ready[rng.below(ready.len())];
                    let op = lanes[r][l][pcs[r][l]].clone();
                    pcs[r][l] += 1;
                    match op {
                        AOp::Copy(d, s, k) => {
                            let b = space.find(s, k).to_vec();
                            space.find(d, k).copy_from_slice(&b);
                        }
                        AOp::Signal(a, v) => {
                            let _ = space.word(a);
                            space.find(a, 4).copy_from_slice(&v.to_le_bytes());
                        }
                        AOp::Reduce(srcs, d, k) => {
                            let mut acc = f32s(space.find(srcs[0], 4 * k));
                            for s in &srcs[1..] {
                                for (a, x) in acc.iter_mut().zip(f32s(space.find(*s, 4 * k))) {
                                    *a += x;
                                }
                            }
                            let b: Vec<u8> = acc.iter().flat_map(|x| x.to_le_bytes()).collect();
                            space.find(d, 4 * k).copy_from_slice(&b);
                        }
                        _ => {}
                    }
                }
                for r in 0..n {
                    let out = f32s(space.find(base(r, if in_place { 0 } else { 1 }), count * 4));
                    for (e, got) in out.iter().enumerate() {
                        let mut want = f32s(&inputs[0][e * 4..e * 4 + 4])[0];
                        for inp in &inputs[1..] {
                            want += f32s(&inp[e * 4..e * 4 + 4])[0];
                        }
                        assert_eq!(got.to_bits(), want.to_bits(), "n={n} rank {r} elem {e}");
                    }
                }
            }
        }
    }
}

/// Each byte crosses the link once each way it must: a rank copies `S` bytes to host memory (its
/// input's chunks for their owners, then its reduced chunk) and `2 (N - 1) S / N` back (its
/// shard from each peer, each peer's reduced chunk).
#[test]
fn bytes_cross_the_link_once() {
    for n in [2, 3, 4, 8] {
        for count in [1, 1000, 4096 * n + 5] {
            for r in 0..n {
                let g = CopyGeom::new(n, r, 2, count, 512, 0);
                let (mut d2h, mut h2d) = (0, 0);
                for (_, op) in schedule(&g) {
                    if let Op::Copy { src, dst } = op {
                        match (src.mem, dst.mem) {
                            (_, Mem::Stage { .. }) => d2h += src.len,
                            (Mem::Stage { .. }, _) => h2d += src.len,
                            _ => panic!("a copy that does not cross the link"),
                        }
                    }
                }
                assert_eq!(d2h, count * 2, "n={n} r={r} count={count}");
                let own: usize = (0..g.pieces()).map(|p| g.chunk(p, r).1).sum();
                assert_eq!(h2d, (n - 1) * own * 2 + (count - own) * 2, "n={n} r={r}");
            }
        }
    }
}
