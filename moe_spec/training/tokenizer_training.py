"""A byte-level BPE tokenizer trained on the corpus' train split.

Byte-level, so any text (including held-out code with unseen identifiers) round-trips exactly.
A single special token serves as bos, eos and pad; it separates files in the training stream.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

END_OF_TEXT = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192


def train_tokenizer(texts: Sequence[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of `vocab_size` entries on `texts`; the special token gets id 0.

    Deterministic for the same texts in the same order.
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=END_OF_TEXT,
        eos_token=END_OF_TEXT,
        pad_token=END_OF_TEXT,
        model_max_length=2048,
    )


def encode_documents(tokenizer: PreTrainedTokenizerFast, texts: Sequence[str]) -> list[int]:
    """One token stream: each text's tokens followed by eos (no bos; the stream starts with a file)."""
    stream: list[int] = []
    for encoding in tokenizer.backend_tokenizer.encode_batch(list(texts), add_special_tokens=False):
        stream.extend(encoding.ids)
        stream.append(tokenizer.eos_token_id)
    return stream
