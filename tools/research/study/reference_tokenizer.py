"""The reference encoding for the study's tokenizer check.

Builds SmolLM2's tokenizer with Hugging Face `tokenizers` from the GGUF file's vocabulary,
merges and control tokens, configured as the model's tokenizer.json is (Digits with individual
digits, then ByteLevel with its regular expression and no prefix space, BPE, the control tokens
as special tokens), encodes a text file and writes the ids one per line, like
`cargo run --release -p flashcomm-study --example encode` (in tools/research). Compare the two
files with `cmp`.

    pip install tokenizers gguf
    python3 reference_tokenizer.py <model.gguf> <text> <ids-out>
"""

import sys

import gguf
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import BPE


def strings_or_ints(reader, key):
    field = reader.fields[key]
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [int(field.parts[i][0]) for i in field.data]


def main(model, text_path, out_path):
    reader = gguf.GGUFReader(model)
    tokens = strings_or_ints(reader, "tokenizer.ggml.tokens")
    merges = strings_or_ints(reader, "tokenizer.ggml.merges")
    types = strings_or_ints(reader, "tokenizer.ggml.token_type")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    controls = [t for t, kind in zip(tokens, types) if kind == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in controls])
    # newline="" keeps CRLF as it is in the file.
    with open(text_path, encoding="utf-8", newline="") as f:
        ids = tok.encode(f.read()).ids
    with open(out_path, "w") as f:
        f.write("".join(f"{i}\n" for i in ids))
    print(f"{len(ids)} tokens, {len(controls)} control tokens", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: reference_tokenizer.py <model.gguf> <text> <ids-out>")
    main(*sys.argv[1:])
