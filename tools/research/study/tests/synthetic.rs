//! Tests of the forward pass and the simulated all-reduce on a tiny random LLaMA model written
//! as a GGUF file in memory (no downloaded model needed).

use flashcomm_study::collective::{
    Backend, Codec, ExactOnly, Mode, Simulated, Spec, spec_effective_bits,
};
use flashcomm_study::expert::Leg;
use flashcomm_study::gguf::{GgmlType, Gguf, Value, Writer};
use flashcomm_study::model::Model;
use flashcomm_study::study::{Run, parse_run, plan};
use half::bf16;

const HIDDEN: usize = 64;
const FFN: usize = 128;
const VOCAB: usize = 50;

struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

fn tensor(w: &mut Writer, rng: &mut Lcg, name: &str, dims: &[u64], scale: f32, offset: f32) {
    let n: u64 = dims.iter().product();
    let data = (0..n)
        .flat_map(|_| (rng.next() * scale + offset).to_le_bytes())
        .collect();
    w.tensor(name, dims, GgmlType::F32, data);
}

fn tiny_model() -> Model {
    let mut rng = Lcg(42);
    let mut w = Writer::new(32);
    w.kv("general.architecture", Value::String("llama".into()))
        .kv("llama.embedding_length", Value::U32(HIDDEN as u32))
        .kv("llama.block_count", Value::U32(2))
        .kv("llama.feed_forward_length", Value::U32(FFN as u32))
        .kv("llama.attention.head_count", Value::U32(4))
        .kv("llama.attention.head_count_kv", Value::U32(2))
        .kv("llama.rope.freq_base", Value::F32(10000.0))
        .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5));
    let (h, f, v) = (HIDDEN as u64, FFN as u64, VOCAB as u64);
    tensor(&mut w, &mut rng, "token_embd.weight", &[h, v], 1.0, 0.0);
    tensor(&mut w, &mut rng, "output_norm.weight", &[h], 0.2, 1.0);
    for l in 0..2 {
        let p = |n: &str| format!("blk.{l}.{n}.weight");
        tensor(&mut w, &mut rng, &p("attn_norm"), &[h], 0.2, 1.0);
        tensor(&mut w, &mut rng, &p("attn_q"), &[h, h], 0.3, 0.0);
        tensor(&mut w, &mut rng, &p("attn_k"), &[h, h / 2], 0.3, 0.0);
        tensor(&mut w, &mut rng, &p("attn_v"), &[h, h / 2], 0.3, 0.0);
        tensor(&mut w, &mut rng, &p("attn_output"), &[h, h], 0.2, 0.0);
        tensor(&mut w, &mut rng, &p("ffn_norm"), &[h], 0.2, 1.0);
        tensor(&mut w, &mut rng, &p("ffn_gate"), &[h, f], 0.3, 0.0);
        tensor(&mut w, &mut rng, &p("ffn_up"), &[h, f], 0.3, 0.0);
        tensor(&mut w, &mut rng, &p("ffn_down"), &[f, h], 0.2, 0.0);
    }
    Model::from_gguf(&Gguf::parse(w.finish()).unwrap()).unwrap()
}

fn tokens(n: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7 + 3) % VOCAB) as u32).collect()
}

#[test]
fn row_parallel_split_matches_a_single_rank() {
    let m = tiny_model();
    let toks = tokens(40);
    let one = m.nll(&toks, &Simulated::new(1, Mode::F32, &ExactOnly));
    for tp in [2, 4, 8] {
        let split = m.nll(&toks, &Simulated::new(tp, Mode::F32, &ExactOnly));
        assert_eq!(split.1, 39);
        assert!(
            (split.0 - one.0).abs() < 1e-4 * one.0.abs(),
            "tp {tp}: {} vs {}",
            split.0,
            one.0
        );
    }
    let b16 = m.nll(&toks, &Simulated::new(2, Mode::Lossless, &Codec));
    assert!((b16.0 - one.0).abs() < 1e-2 * one.0.abs());
}

#[test]
fn attention_is_causal() {
    let m = tiny_model();
    let mut a = tokens(12);
    let ar = Simulated::new(2, Mode::F32, &ExactOnly);
    let ha = m.hidden_states(&a, &ar);
    a[11] = (a[11] + 1) % VOCAB as u32;
    let hb = m.hidden_states(&a, &ar);
    for t in 0..11 {
        assert_eq!(ha.row(t), hb.row(t), "row {t}");
    }
    assert_ne!(ha.row(11), hb.row(11));
}

#[test]
fn quantized_all_reduce_error_grows_as_bits_shrink() {
    let m = tiny_model();
    let toks = tokens(64);
    let mut last = 0.0;
    for bits in [8, 4, 2] {
        let f = Spec {
            bits,
            group: 32,
            spikes: 2,
        };
        let ar = Simulated::new(2, Mode::TwoStep { rs: f, ag: f }, &Codec);
        m.nll(&toks, &ar);
        let st = ar.stats();
        assert_eq!(st.calls, 4);
        assert!(
            st.rel_l2() > last,
            "{bits} bits: {} after {last}",
            st.rel_l2()
        );
        last = st.rel_l2();
    }
    assert!(last < 0.5);
}

#[test]
fn backends_agree() {
    let a: Vec<bf16> = (0..3000)
        .map(|i| bf16::from_f32((i as f32 * 0.37).sin() * 3.0))
        .collect();
    let b: Vec<bf16> = (0..3000)
        .map(|i| bf16::from_f32((i as f32 * 0.11).cos()))
        .collect();
    let inputs = [a.as_slice(), b.as_slice()];
    assert_eq!(ExactOnly.lossless(&inputs), Codec.lossless(&inputs));
    let f = Spec {
        bits: 8,
        group: 64,
        spikes: 0,
    };
    assert_eq!(Codec.two_step(f, f, &inputs).unwrap().len(), 3000);
    assert!(ExactOnly.two_step(f, f, &inputs).is_err());
    for bits in 2..=8 {
        for group in [32, 64, 128, 256] {
            for spikes in [0, 2, 4] {
                let f = Spec {
                    bits,
                    group,
                    spikes,
                };
                assert_eq!(
                    Codec.effective_bits(f).unwrap(),
                    spec_effective_bits(f),
                    "{f}"
                );
            }
        }
    }
}

#[test]
fn settings_parse_and_plans_are_complete() {
    let f = Spec {
        bits: 4,
        group: 32,
        spikes: 2,
    };
    assert_eq!(parse_run("2:exact").unwrap(), Run::new(2, Mode::Lossless));
    assert_eq!(
        parse_run("4:two:4:32:2").unwrap(),
        Run::new(4, Mode::TwoStep { rs: f, ag: f })
    );
    assert_eq!(
        parse_run("2:one:4:32:2").unwrap(),
        Run::new(2, Mode::OneShot(f))
    );
    let ag = Spec { bits: 8, ..f };
    assert_eq!(
        parse_run("8:mixed:4:8:32:2").unwrap(),
        Run::new(8, Mode::TwoStep { rs: f, ag })
    );
    assert!(parse_run("2:two:4:32").is_err());
    assert!(parse_run("x:exact").is_err());
    let scoped = parse_run("2:two:4:32:2@0-27:both").unwrap();
    assert_eq!((scoped.scope.first_layer, scoped.scope.end_layer), (0, 28));
    assert!(parse_run("2:exact@x").is_err());
    let rot = parse_run("2:one:4:128:2:rot").unwrap();
    assert!(rot.rotate && !parse_run("2:one:4:128:2").unwrap().rotate);
    assert_eq!(rot.algorithm(), "one-shot + rot");
    let f128 = Spec { group: 128, ..f };
    assert_eq!(rot, Run::new(2, Mode::OneShot(f128)).rotated(true));
    let rot_scoped = parse_run("2:two:4:32:2:rot@0-27:both").unwrap();
    assert!(rot_scoped.rotate && rot_scoped.scope.end_layer == 28);
    assert!(parse_run("8:mixed:4:8:32:2:rot").unwrap().rotate);
    assert!(parse_run("2:exact:rot").is_err());
    assert!(parse_run("2:two:4:32:rot").is_err());
    let rot_plan = plan("rot").unwrap();
    assert_eq!(rot_plan.len(), 1 + 36);
    assert!(rot_plan[1..].iter().all(|r| r.rotate));
    let tp2 = plan("tp2").unwrap();
    assert_eq!(tp2.len(), 2 + 56 + 8 + 6 + 56);
    assert!(plan("full").unwrap().len() > tp2.len());
    assert!(plan("nope").is_err());
}

#[test]
fn scope_limits_the_quantized_all_reduces() {
    use flashcomm_study::collective::Scope;
    use flashcomm_study::model::Site;
    let s = Scope::parse("0-0:down").unwrap();
    assert!(
        s.contains(0, Site::DownProj)
            && !s.contains(0, Site::OProj)
            && !s.contains(1, Site::DownProj)
    );
    assert_eq!(Scope::parse("all:both").unwrap(), Scope::ALL);
    assert_eq!(Scope::parse("0-27:both").unwrap().to_string(), "0-27:both");
    assert_eq!(s.to_string(), "0:down");
    assert!(Scope::parse("3:x").is_err());
    let m = tiny_model();
    let toks = tokens(64);
    let f = Spec {
        bits: 2,
        group: 32,
        spikes: 0,
    };
    let mode = Mode::TwoStep { rs: f, ag: f };
    let none = Simulated::new(2, mode, &Codec).with_scope(Scope {
        first_layer: 0,
        end_layer: 0,
        o_proj: true,
        down_proj: true,
    });
    let exact = Simulated::new(2, Mode::Lossless, &Codec);
    assert_eq!(m.nll(&toks, &none), m.nll(&toks, &exact));
    assert_eq!(none.stats().sq_err, 0.0);
    let one = Simulated::new(2, mode, &Codec).with_scope(s);
    m.nll(&toks, &one);
    assert!(one.stats().sq_err > 0.0);
}

#[test]
fn change_cells() {
    use flashcomm_study::study::change_cell;
    assert_eq!(change_cell(0.0455), "+4.55%");
    assert_eq!(change_cell(-0.002), "-0.20%");
    assert_eq!(change_cell(3.3535), "×4.4");
    assert_eq!(change_cell(5955.84), "×5957");
}

#[test]
fn rotation_runs_around_the_codec() {
    let m = tiny_model();
    let toks = tokens(64);
    let f = Spec {
        bits: 8,
        group: 32,
        spikes: 0,
    };
    for mode in [Mode::TwoStep { rs: f, ag: f }, Mode::OneShot(f)] {
        let plain = Simulated::new(2, mode, &Codec).with_row(HIDDEN);
        let rot = Simulated::new(2, mode, &Codec).with_rotation(true);
        m.nll(&toks, &plain);
        m.nll(&toks, &rot);
        let (p, r) = (plain.stats(), rot.stats());
        assert_eq!(r.calls, 4);
        // The error without the first token: part of the whole; not measured without the row.
        assert!(p.sq_err_rest > 0.0 && p.sq_err_rest < p.sq_err);
        assert!(p.sq_ref_rest > 0.0 && p.sq_ref_rest < p.sq_ref);
        assert_eq!((r.sq_err_rest, r.rel_l2_rest()), (0.0, 0.0));
        // A different error, of the same small size (8 bits, plus the bf16 rounding of the
        // rotated values and of the result).
        assert_ne!(p.sq_err, r.sq_err);
        assert!(r.rel_l2() > 0.0 && r.rel_l2() < 0.02, "{}", r.rel_l2());
    }
    // A moderate outlier in every group: the rotation spreads it over the group, so the group's
    // range, and with it the step, shrinks, and the error falls without spikes.
    let n = 4096;
    let a: Vec<f32> = (0..n)
        .map(|i| {
            if i % 128 == 5 {
                20.0
            } else {
                (i as f32 * 0.37).sin()
            }
        })
        .collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let partials = vec![a, b];
    let g = Spec {
        bits: 4,
        group: 128,
        spikes: 0,
    };
    let err = |rotate: bool| {
        use flashcomm_study::model::{AllReduce, Site};
        let ar = Simulated::new(2, Mode::OneShot(g), &Codec).with_rotation(rotate);
        ar.all_reduce(0, Site::DownProj, &partials);
        ar.stats().sq_err
    };
    assert!(err(true) < err(false), "{} vs {}", err(true), err(false));
    // The exact modes ignore the rotation.
    let exact = Simulated::new(2, Mode::Lossless, &Codec).with_rotation(true);
    m.nll(&toks, &exact);
    assert_eq!(exact.stats().sq_err, 0.0);
}

#[test]
fn spikes_first_settings_parse() {
    let f = Spec {
        bits: 4,
        group: 32,
        spikes: 2,
    };
    let srot = parse_run("2:one:4:32:2:srot").unwrap();
    assert!(srot.spikes_first && !srot.rotate);
    assert_eq!(srot.algorithm(), "one-shot + srot");
    assert_eq!(
        srot,
        Run::new(2, Mode::OneShot(f)).spikes_then_rotated(true)
    );
    assert!(!parse_run("2:one:4:32:2:rot").unwrap().spikes_first);
    let two = parse_run("2:two:3:64:2:srot@0-27:both").unwrap();
    assert!(two.spikes_first && two.scope.end_layer == 28);
    assert_eq!(two.algorithm(), "two-step + srot");
    assert!(parse_run("8:mixed:4:8:32:2:srot").unwrap().spikes_first);
    assert!(parse_run("2:exact:srot").is_err());
    assert!(parse_run("2:one:4:32:2:srot:rot").is_err());
    let p = plan("srot").unwrap();
    assert_eq!(p.len(), 1 + 12);
    assert!(p[1..].iter().all(|r| r.spikes_first && !r.rotate));
}

#[test]
fn oracle_and_grid_settings_parse_and_run() {
    let f = Spec {
        bits: 3,
        group: 64,
        spikes: 2,
    };
    let o = parse_run("2:oracle:3:64:2").unwrap();
    assert_eq!(o, Run::new(2, Mode::Oracle(f)));
    assert_eq!(o.algorithm(), "oracle bound");
    let g = parse_run("2:grid:3:64:2:15@0-27:both").unwrap();
    assert_eq!(g.mode, Mode::Grid(f, 15));
    assert_eq!(g.algorithm(), "one-shot grid p1.5");
    assert_eq!(g.scope.end_layer, 28);
    for bad in [
        "2:oracle:3:64:2:srot",
        "2:grid:3:64:2:15:srot",
        "2:grid:3:64:2:9",
        "2:grid:3:64:2:41",
        "2:grid:3:64:2",
        "2:oracle:3:64",
    ] {
        assert!(parse_run(bad).is_err(), "{bad}");
    }
    let p = plan("oracle").unwrap();
    assert_eq!(p.len(), 1 + 20);
    assert!(p[1..].iter().all(|r| matches!(r.mode, Mode::Oracle(_))));

    // Both run through the simulated all-reduce (no codec backend needed) and their error is
    // measured against the exact sum: the oracle's is below the grid's at the same format.
    let inputs: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            (0..2048)
                .map(|i| {
                    ((i * 37 + r * 11) % 101) as f32 / 50.0 - 1.0 + if i == 5 { 900.0 } else { 0.0 }
                })
                .collect()
        })
        .collect();
    use flashcomm_study::model::{AllReduce, Site};
    let err = |mode: Mode| {
        let ar = Simulated::new(2, mode, &ExactOnly);
        let out = ar.all_reduce(3, Site::DownProj, &inputs);
        assert_eq!(out.len(), 2048);
        ar.stats().rel_l2()
    };
    let (eo, eg) = (err(Mode::Oracle(f)), err(Mode::Grid(f, 10)));
    assert!(eo > 0.0 && eo < eg, "oracle {eo}, grid {eg}");
}

#[test]
fn spikes_first_runs_around_the_codec() {
    use flashcomm_study::model::{AllReduce, Site};
    let m = tiny_model();
    let toks = tokens(64);
    let f = Spec {
        bits: 8,
        group: 32,
        spikes: 2,
    };
    for mode in [Mode::TwoStep { rs: f, ag: f }, Mode::OneShot(f)] {
        let plain = Simulated::new(2, mode, &Codec);
        let srot = Simulated::new(2, mode, &Codec)
            .with_rotation(true)
            .with_spikes_first(true);
        m.nll(&toks, &plain);
        m.nll(&toks, &srot);
        let (p, s) = (plain.stats(), srot.stats());
        assert_eq!(s.calls, 4);
        assert_ne!(p.sq_err, s.sq_err);
        assert!(s.rel_l2() > 0.0 && s.rel_l2() < 0.02, "{}", s.rel_l2());
    }
    // A massive value in one group and a moderate outlier in every group: the spikes keep the
    // massive value, the rotation spreads the rest; better than either alone at 4-bit g128 k2.
    let n = 4096;
    let a: Vec<f32> = (0..n)
        .map(|i| match i {
            7 => 25_000.0,
            _ if i % 128 == 5 || i % 128 == 77 || i % 128 == 100 => 20.0,
            _ => (i as f32 * 0.37).sin(),
        })
        .collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
    let partials = vec![a, b];
    let g = Spec {
        bits: 4,
        group: 128,
        spikes: 2,
    };
    let err = |rotate: bool, spikes_first: bool| {
        let ar = Simulated::new(2, Mode::OneShot(g), &Codec)
            .with_rotation(rotate)
            .with_spikes_first(spikes_first);
        let out = ar.all_reduce(0, Site::DownProj, &partials);
        // The massive value comes back as the exact all-reduce gives it.
        if spikes_first || !rotate {
            let exact = bf16::from_f32(25_000.0 + partials[1][7]).to_f32();
            assert_eq!(
                out[7], exact,
                "rotate {rotate}, spikes first {spikes_first}"
            );
        }
        ar.stats().sq_err
    };
    let (plain, rot, srot) = (err(false, false), err(true, false), err(false, true));
    assert!(srot < plain && srot < rot, "{srot} vs {plain}, {rot}");
    // The exact modes ignore it; a backend without it refuses.
    let exact = Simulated::new(2, Mode::Lossless, &ExactOnly).with_spikes_first(true);
    m.nll(&toks, &exact);
    assert_eq!(exact.stats().sq_err, 0.0);
    let inputs = [&[bf16::ONE; 64][..], &[bf16::ONE; 64][..]];
    assert!(ExactOnly.one_shot_spikes_rotated(g, &inputs).is_err());
    assert!(ExactOnly.two_step_spikes_rotated(g, g, &inputs).is_err());
    assert_eq!(Codec.one_shot_spikes_rotated(g, &inputs).unwrap().len(), 64);
}

#[test]
fn json_results_parse_back() {
    use flashcomm_study::collective::ErrorStats;
    use flashcomm_study::study::{RunResult, json};
    use std::time::Duration;
    let f = Spec {
        bits: 4,
        group: 128,
        spikes: 2,
    };
    let result = |mode, nll, eb| RunResult {
        run: Run::new(2, mode),
        nll,
        tokens: 100,
        stats: ErrorStats {
            calls: 3,
            ..ErrorStats::default()
        },
        dispatch: ErrorStats::default(),
        combine: ErrorStats::default(),
        effective_bits: eb,
        cpu_time: Duration::from_millis(1234),
    };
    let results = [
        result(Mode::Lossless, 100.0, None),
        result(Mode::TwoStep { rs: f, ag: f }, 110.0, Some((4.5, 4.5))),
        result(Mode::TwoStep { rs: f, ag: f }, f64::NAN, Some((4.5, 4.5))),
    ];
    let meta = [("model", "a \"quoted\" name".to_string())];
    let text = json(&results, &meta).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["model"], "a \"quoted\" name");
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    assert!(rows[0]["rs"].is_null() && rows[0]["effective_bits"].is_null());
    assert_eq!(rows[1]["rs"]["bits"], 4);
    assert_eq!(rows[1]["effective_bits"], 4.5);
    assert_eq!(rows[1]["tokens"], 100);
    assert_eq!(rows[1]["allreduce_calls"], 3);
    assert_eq!(rows[1]["cpu_seconds"], 1.234);
    // The exact run is the baseline: a 10% larger NLL sum is exp(0.1) times its perplexity.
    let change = rows[1]["relative_change"].as_f64().unwrap();
    assert!((change - (0.1f64.exp() - 1.0)).abs() < 1e-12, "{change}");
    assert_eq!(rows[1]["ar_rel_l2_error"], 0.0);
    // A perplexity that is not a number is written as null, and the document stays valid.
    assert!(rows[2]["ppl"].is_null() && rows[2]["relative_change"].is_null());
}

fn ep(dispatch: Leg, combine: Leg) -> Mode {
    Mode::Ep { dispatch, combine }
}

#[test]
fn ep_settings_parse_and_the_plan_is_complete() {
    let f = Spec {
        bits: 4,
        group: 128,
        spikes: 2,
    };
    let q = Leg::Quantized(f);
    assert_eq!(
        parse_run("ep:f32").unwrap(),
        Run::new(1, ep(Leg::F32, Leg::F32))
    );
    assert_eq!(parse_run("ep:exact").unwrap(), Run::new(1, Mode::EP_EXACT));
    assert_eq!(
        parse_run("ep:dispatch:4:128:2").unwrap(),
        Run::new(1, ep(q, Leg::Exact))
    );
    assert_eq!(
        parse_run("ep:combine:4:128:2").unwrap(),
        Run::new(1, ep(Leg::Exact, q))
    );
    let both = parse_run("ep:both:4:128:2").unwrap();
    assert_eq!(both, Run::new(1, ep(q, q)));
    assert_eq!(both.algorithm(), "EP dispatch + combine");
    assert_eq!(both.mode.formats(), Some((f, f)));
    assert_eq!(
        parse_run("ep:dispatch:4:128:2").unwrap().algorithm(),
        "EP dispatch"
    );
    assert_eq!(
        parse_run("ep:combine:4:128:2").unwrap().mode.formats(),
        Some((f, f))
    );
    assert_eq!(parse_run("ep:exact").unwrap().mode.formats(), None);
    let scoped = parse_run("ep:both:4:128:2@0-27:both").unwrap();
    assert_eq!((scoped.scope.first_layer, scoped.scope.end_layer), (0, 28));
    assert_eq!(scoped.mode, ep(q, q));
    for bad in [
        "ep:",
        "ep:both",
        "ep:both:4:128",
        "ep:both:4:128:2:1",
        "ep:two:4:128:2",
        "ep:exact:4:128:2",
        "ep:both:4:128:2:rot",
        "ep:both:4:128:2:srot",
        "ep:both:300:128:2",
        "ep:both:4:x:2",
        "ep:both:4:128:2@0-27:down",
        "ep:exact@x",
        "2:ep:both:4:128:2",
    ] {
        assert!(parse_run(bad).is_err(), "{bad}");
    }
    // The tensor-parallel syntax is unchanged.
    assert!(!parse_run("2:two:4:128:2").unwrap().mode.is_ep());
    let p = plan("ep").unwrap();
    assert_eq!(p.len(), 2 + 7 * 4 * 3 + 2 * 7 * (4 + 2));
    assert!(p.iter().all(|r| r.mode.is_ep() && r.tp == 1));
    assert_eq!(p[1].mode, Mode::EP_EXACT);
    let count = |d: bool, c: bool| {
        p.iter()
            .filter(|r| {
                matches!(r.mode, Mode::Ep { dispatch, combine }
                    if dispatch.spec().is_some() == d && combine.spec().is_some() == c)
            })
            .count()
    };
    assert_eq!(
        (count(true, true), count(true, false), count(false, true)),
        (84, 42, 42)
    );
    let mut unique = p.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), p.len());
}

#[test]
fn exact_ep_is_the_plain_model() {
    let m = tiny_model();
    let toks = tokens(64);
    let plain = Simulated::new(1, Mode::F32, &ExactOnly);
    let f32_ep = Simulated::new(1, ep(Leg::F32, Leg::F32), &ExactOnly);
    // Nothing rounded: bit for bit the plain single-rank model.
    assert_eq!(m.nll(&toks, &f32_ep), m.nll(&toks, &plain));
    assert_eq!(
        m.hidden_states(&toks, &f32_ep),
        m.hidden_states(&toks, &plain)
    );
    // The exact bf16 all-to-alls: the MLP's input and output rounded to bf16, nothing else; the
    // backend's quantized paths are never called (the exact-only backend has none).
    let exact = Simulated::new(1, Mode::EP_EXACT, &ExactOnly);
    let (a, b) = (m.nll(&toks, &exact), m.nll(&toks, &plain));
    assert_ne!(a.0, b.0);
    assert!((a.0 - b.0).abs() < 1e-2 * b.0.abs(), "{} vs {}", a.0, b.0);
    assert_eq!(exact.dispatch_stats().calls, 0);
    assert_eq!(exact.combine_stats().calls, 0);
    // No all-reduce error in any EP mode: TP = 1, the single partial used as it is.
    assert_eq!(exact.stats().sq_err, 0.0);
    assert_eq!(exact.stats().calls, 4);
    // A quantized setting whose scope holds no layer is the exact one.
    use flashcomm_study::collective::Scope;
    let f = Leg::Quantized(Spec {
        bits: 2,
        group: 32,
        spikes: 0,
    });
    let none = Simulated::new(1, ep(f, f), &Codec).with_scope(Scope {
        first_layer: 0,
        end_layer: 0,
        o_proj: true,
        down_proj: true,
    });
    assert_eq!(m.nll(&toks, &none), a);
    assert_eq!(none.dispatch_stats().calls, 2);
    assert_eq!(none.dispatch_stats().sq_err, 0.0);
    let quantized = Simulated::new(1, ep(f, f), &Codec);
    assert_ne!(m.nll(&toks, &quantized), a);
    // The exact-only backend has no quantized all-to-all.
    let block = [bf16::ONE; 64];
    assert!(
        ExactOnly
            .all_to_all_block(
                Spec {
                    bits: 8,
                    group: 32,
                    spikes: 0
                },
                &block
            )
            .is_err()
    );
}

#[test]
fn ep_legs_quantize_what_they_say() {
    let m = tiny_model();
    let toks = tokens(64);
    let mut last = (0.0, 0.0);
    for bits in [8, 4, 2] {
        let f = Leg::Quantized(Spec {
            bits,
            group: 32,
            spikes: 2,
        });
        let d = Simulated::new(1, ep(f, Leg::Exact), &Codec).with_row(HIDDEN);
        let c = Simulated::new(1, ep(Leg::Exact, f), &Codec).with_row(HIDDEN);
        m.nll(&toks, &d);
        m.nll(&toks, &c);
        // One all-to-all per layer on the quantized leg, none counted on the exact one.
        assert_eq!((d.dispatch_stats().calls, d.combine_stats().calls), (2, 0));
        assert_eq!((c.dispatch_stats().calls, c.combine_stats().calls), (0, 2));
        let (ed, ec) = (d.dispatch_stats().rel_l2(), c.combine_stats().rel_l2());
        assert!(ed > last.0 && ec > last.1, "{bits} bits: {ed}, {ec}");
        assert!(d.dispatch_stats().rel_l2_rest() > 0.0);
        // The codec keeps its bound at every width.
        assert!(d.dispatch_stats().max_err_over_bound <= 1.0);
        assert!(c.combine_stats().max_err_over_bound <= 1.0);
        last = (ed, ec);
    }
    assert!(last.0 < 0.5 && last.1 < 0.5);
}

#[test]
fn ep_at_eight_bits_moves_the_mlp_input_within_the_codec_bound() {
    use flashcomm_study::model::AllReduce;
    // A [tokens × hidden] block with one large value, as the MLP input of a real model has.
    let (t, h) = (16, 576);
    let x: Vec<f32> = (0..t * h)
        .map(|i| match i {
            507 => 120.0,
            _ => ((i * 37 % 101) as f32 / 50.0 - 1.0) * (1.0 + (i % h) as f32 / 300.0),
        })
        .collect();
    for (group, spikes) in [(32u16, 2u8), (64, 0), (128, 2), (256, 4)] {
        let f = Spec {
            bits: 8,
            group,
            spikes,
        };
        let ar = Simulated::new(1, ep(Leg::Quantized(f), Leg::Exact), &Codec);
        let y = ar.dispatch(3, x.clone());
        assert_eq!(y.len(), x.len());
        // The codec's bound at 8 bits: half a step of the group's range (255 steps, a little
        // slack for the bf16 range table), plus the bf16 rounding of the input and of the
        // decoded value.
        for (gi, (xs, ys)) in x
            .chunks(group.into())
            .zip(y.chunks(group.into()))
            .enumerate()
        {
            let lo = xs.iter().fold(f32::INFINITY, |a, &v| a.min(v));
            let hi = xs.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            for (&a, &b) in xs.iter().zip(ys) {
                let ulp = |v: f32| (v.abs().max(1e-30)).log2().floor().exp2() / 128.0;
                let bound = (hi - lo) / 255.0 * 0.51 + ulp(a) + ulp(b);
                assert!(
                    (a - b).abs() <= bound,
                    "{f}, group {gi}: {a} -> {b}, {bound}"
                );
            }
        }
        let st = ar.dispatch_stats();
        assert_eq!(st.calls, 1);
        assert!(st.max_err_over_bound > 0.0 && st.max_err_over_bound <= 1.0);
        assert!(
            st.rel_l2() > 0.0 && st.rel_l2() < 2e-2,
            "{f}: {}",
            st.rel_l2()
        );
        assert_eq!(st.max_abs_input, 120.0);
        // The combine hook leaves a dispatch-only setting's output as bf16.
        let z = ar.combine(3, x.clone());
        assert!(
            z.iter()
                .zip(&x)
                .all(|(&a, &b)| a == bf16::from_f32(b).to_f32())
        );
        // Outside the EP modes the hooks do nothing.
        let tp = Simulated::new(2, Mode::OneShot(f), &Codec);
        assert_eq!(tp.dispatch(3, x.clone()), x);
        assert_eq!(tp.combine(3, x.clone()), x);
    }
}

#[test]
fn ep_groups_stay_inside_a_token_when_they_divide_the_hidden_size() {
    // hidden = 576: groups of 32 and 64 never straddle two tokens, so a token's round trip does
    // not depend on the other tokens of the block; groups of 128 and 256 do straddle them.
    let (t, h) = (6, 576);
    let x: Vec<bf16> = (0..t * h)
        .map(|i| bf16::from_f32(((i * 53 % 211) as f32 / 100.0 - 1.0) * (1 + i / h) as f32))
        .collect();
    for (group, aligned) in [(32u16, true), (64, true), (128, false), (256, false)] {
        let f = Spec {
            bits: 3,
            group,
            spikes: 2,
        };
        let (all, _) = Codec.all_to_all_block(f, &x).unwrap();
        let independent = (0..t).all(|k| {
            let row = &x[k * h..(k + 1) * h];
            Codec.all_to_all_block(f, row).unwrap().0 == all[k * h..(k + 1) * h]
        });
        assert_eq!(independent, aligned, "g{group}");
    }
}

#[test]
fn ep_results_in_tables_and_json() {
    use flashcomm_study::collective::ErrorStats;
    use flashcomm_study::study::{RunResult, json, markdown_table, markdown_table_ep, pivot_ep};
    use std::time::Duration;
    let f = Spec {
        bits: 4,
        group: 128,
        spikes: 2,
    };
    let q = Leg::Quantized(f);
    let leg_stats = ErrorStats {
        sq_err: 1.0,
        sq_ref: 100.0,
        calls: 30,
        ..ErrorStats::default()
    };
    let result = |mode, nll, d: bool, c: bool| RunResult {
        run: Run::new(1, mode),
        nll,
        tokens: 100,
        stats: ErrorStats::default(),
        dispatch: if d { leg_stats } else { ErrorStats::default() },
        combine: if c { leg_stats } else { ErrorStats::default() },
        effective_bits: Mode::formats(&mode).map(|_| (4.75, 4.75)),
        cpu_time: Duration::ZERO,
    };
    let results = [
        result(Mode::EP_EXACT, 100.0, false, false),
        result(ep(q, q), 110.0, true, true),
        result(ep(q, Leg::Exact), 105.0, true, false),
        result(Mode::Lossless, 90.0, false, false),
    ];
    // The EP settings are compared with the exact all-to-alls, not with an all-reduce.
    let table = markdown_table_ep(&results);
    assert!(table.contains("| EP dispatch + combine | 4 | 128 | 2 | 4.750 |"));
    assert!(
        table.contains("| 1.00e-1 | 1.00e-1 | missed (≤1%) |"),
        "{table}"
    );
    assert!(table.contains("| EP exact (bf16) | - | - | - | 16 (bf16) |"));
    assert_eq!(table.lines().count(), 2 + 3);
    assert_eq!(markdown_table(&results).lines().count(), 2 + 1);
    let pivot = pivot_ep(&results, true, false);
    assert!(pivot.contains("| 4 | +5.13% (4.750) |"), "{pivot}");
    let v: serde_json::Value = serde_json::from_str(&json(&results, &[]).unwrap()).unwrap();
    let rows = v["results"].as_array().unwrap();
    assert!(rows[3].get("ep").is_none());
    assert_eq!(rows[0]["ep"]["dispatch"], "bf16");
    assert_eq!(rows[1]["ep"]["combine"]["format"]["group"], 128);
    assert_eq!(rows[1]["ep"]["combine"]["rel_l2_error"], 0.1);
    assert_eq!(rows[2]["ep"]["combine"], "bf16");
    assert!(rows[2]["rs"].is_null() && rows[2]["effective_bits"] == 4.75);
    let change = rows[1]["relative_change"].as_f64().unwrap();
    assert!((change - (0.1f64.exp() - 1.0)).abs() < 1e-12, "{change}");
}
