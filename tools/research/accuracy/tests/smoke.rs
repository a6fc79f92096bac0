//! A small run of the whole study: the numbers behave as the codec promises, and the headline
//! property (spikes cut the error of heavy-tailed data at 2 and 3 bits) holds.

use flashcomm_accuracy::{Algorithm, Parts, Record, Sizes, report, run};

const TINY: Sizes = Sizes {
    gaussian: 1 << 11,
    heavy: (4, 1024),
    heavy_ranks: 2,
    linear: (2, 64, 512),
};

fn find(rs: &[Record], a: Algorithm, bits: u8, group: u16, spikes: u8) -> &Record {
    rs.iter()
        .find(|r| {
            r.algorithm == a
                && r.format
                    .is_some_and(|f| f.bits() == bits && f.group() == group && f.spikes() == spikes)
        })
        .expect("measured")
}

#[test]
fn study_smoke() {
    let parts = Parts {
        gaussian: true,
        heavy: true,
        linear: true,
    };
    let sections = run(7, TINY, parts);
    assert_eq!(sections.len(), 5);

    // Gaussian: more bits, less error; 8 bits is within 1%.
    let g = &sections[0].records;
    for group in [32u16, 64, 128, 256] {
        for k in [0u8, 2, 4] {
            let errs: Vec<f64> = (2..=8)
                .map(|b| find(g, Algorithm::OneShot, b, group, k).all.rel_l2)
                .collect();
            assert!(
                errs.windows(2).all(|w| w[1] < w[0]),
                "{group} {k}: {errs:?}"
            );
            assert!(errs[6] < 0.01);
        }
    }

    // Heavy-tailed: at 2 and 3 bits, spikes cut the non-spike error by at least a third.
    let h = &sections[1].records;
    for a in [Algorithm::OneShot, Algorithm::TwoStep] {
        for bits in [2u8, 3] {
            let k0 = find(h, a, bits, 128, 0).non_spike.unwrap().rel_l2;
            let k2 = find(h, a, bits, 128, 2).non_spike.unwrap().rel_l2;
            assert!(k2 < 0.67 * k0, "{a:?} b{bits}: k0 {k0} k2 {k2}");
        }
    }
    // The lossless reference only carries the bf16 rounding.
    for s in &sections[1..] {
        let l = s
            .records
            .iter()
            .find(|r| r.algorithm == Algorithm::Lossless)
            .unwrap();
        assert!(l.all.rel_l2 < 5e-3, "{}", l.all.rel_l2);
    }

    // Both outputs render every section.
    let md = report::markdown(&sections);
    assert_eq!(md.matches("### ").count(), 5);
    let json = report::json(&sections).unwrap();
    assert_eq!(json.matches('{').count(), json.matches('}').count());
    assert!(json.contains("\"algorithm\": \"two-step\""));

    // The data is deterministic for a seed.
    let a = flashcomm_accuracy::data::heavy_tailed(7, 4, 1024, 2);
    let b = flashcomm_accuracy::data::heavy_tailed(7, 4, 1024, 2);
    assert_eq!(a.exact, b.exact);
    assert_eq!(a.spike_mask, b.spike_mask);
}
