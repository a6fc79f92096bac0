//! Tests of the forward pass and the simulated all-reduce on a tiny random LLaMA model written
//! as a GGUF file in memory (no downloaded model needed).

use flashcomm_study::collective::{
    Backend, Codec, ExactOnly, Mode, Simulated, Spec, spec_effective_bits,
};
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
