//! Checks against the real SmolLM2-135M-Instruct GGUF file. The file is not in the repository
//! (`ci/get-model.sh` fetches it); these tests skip, saying why, when it is absent. The path is
//! `$FLASHCOMM_STUDY_MODEL`, or `.toolchain/models/SmolLM2-135M-Instruct.Q4_1.gguf` of the
//! repository.

use flashcomm_study::collective::{ExactOnly, Mode, Simulated};
use flashcomm_study::gguf::{GgmlType, Gguf};
use flashcomm_study::model::{Model, rows};
use flashcomm_study::tokenizer::Tokenizer;
use std::path::PathBuf;

fn model_path() -> Option<PathBuf> {
    let p = match std::env::var_os("FLASHCOMM_STUDY_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../.toolchain/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if p.is_file() {
        Some(p)
    } else {
        println!(
            "skipped: model file {} is absent (run ci/get-model.sh .toolchain/models)",
            p.display()
        );
        None
    }
}

#[test]
fn reads_the_file_and_predicts_paris() {
    let Some(path) = model_path() else { return };
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.tensors.len(), 272);
    let count = |ty| g.tensors.iter().filter(|t| t.ty == ty).count();
    assert_eq!(
        (
            count(GgmlType::Q4_1),
            count(GgmlType::Q8_0),
            count(GgmlType::F32)
        ),
        (210, 1, 61)
    );
    let params: u64 = g.tensors.iter().map(|t| t.n_elements()).sum();
    assert_eq!(params, 134_515_008);

    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    let prompt = tok.encode("The capital of France is");
    assert_eq!(prompt.len(), 5);
    let text = " = Robert <unk> = \n \n Robert <unk> is an English film , television and theatre actor . He had a guest @-@ starring role in 2000 .\n";
    assert_eq!(tok.decode(&tok.encode(text)), text);

    let model = Model::from_gguf(&g).unwrap();
    let ar = Simulated::new(2, Mode::F32, &ExactOnly);
    let h = model.hidden_states(&prompt, &ar);
    let logits = model.logits(rows(&h, prompt.len() - 1..prompt.len()));
    let row = logits.row(0);
    let best = (0..row.len())
        .max_by(|&a, &b| row[a].total_cmp(&row[b]))
        .unwrap();
    assert_eq!(tok.decode(&[best as u32]), " Paris");
}
