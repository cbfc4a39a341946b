"""The tokenizer (trained on the catalog, or a pretrained BERT's), texts to token rows (cached and
word-at-a-time encoders), and the holdout split by query key."""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from .errors import BadInputError

log = logging.getLogger("pipeline_steps.data")  # one logger for the data layer

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def _continuing_subword_tokens(tokenizer: Tokenizer, texts: Sequence[str], chunk: int = 1_000) -> list[str]:
    """"##c" for every character of the normalised `texts` that can occur inside a word, sorted:
    all but whitespace and punctuation, where the BERT pre-tokenizer splits (a character seen only
    at word starts adds an unused token, which is harmless). The normalizer maps characters one by
    one, so the characters of the normalised texts are those of their normalised distinct characters."""
    seen = np.zeros(0x110000, dtype=bool)
    for start in range(0, len(texts), chunk):  # code points found by numpy, not one Python str per character
        seen[np.frombuffer("".join(texts[start:start + chunk]).encode("utf-32-le"), dtype=np.uint32)] = True
    chars = set("".join(tokenizer.normalizer.normalize_str(chr(c)) for c in np.flatnonzero(seen).tolist()))
    inside = (c for c in chars if not c.isspace() and not unicodedata.category(c).startswith("P"))
    return ["##" + c for c in sorted(inside)]


TOKENIZER_WORDS = 100_000
"""Distinct words the tokenizer is trained on at most: the most frequent of its sample. The
trainer's merge loop costs time in the distinct words (395,000 words of a large vocabulary took
10.7 CPU s, its 100,000 most frequent 3.2 s); the words left out are the rarest, which WordPiece
then splits into the pieces it learned from the others (docs/data.md, "The tokenizer")."""


def _word_feed(texts: Sequence[str], max_words: int) -> Iterator[str]:
    """What the trainer reads: each of the `max_words` most frequent space-separated words of
    `texts` (ties broken by the word's UTF-8 bytes), repeated as often as it occurs. The trainer
    learns from the count of each word, whatever text it came in, so under `max_words` distinct words
    this is the same input as `texts`: the normalizer maps characters one by one and the
    pre-tokenizer splits at spaces (what WordEncoder relies on), and a string per word costs less."""
    counts = pc.value_counts(pc.list_flatten(pc.split_pattern(pa.array(texts, pa.string()), " ")))
    table = pa.table({"word": counts.field("values"), "count": counts.field("counts")})
    if len(table) > max_words:
        table = table.sort_by([("count", "descending"), ("word", "ascending")]).slice(0, max_words)
    return (f"{word} " * count for word, count in zip(table.column("word").to_pylist(),
                                                     table.column("count").to_pylist()))


def train_tokenizer(texts: Sequence[str], vocab_size: int, max_words: int = TOKENIZER_WORDS) -> Tokenizer:
    """A BERT-style WordPiece tokenizer trained on the `max_words` most frequent words of `texts`:
    NFD + lowercase + strip accents, whitespace/punctuation pre-tokenisation, [PAD]=0 [UNK]=1
    [CLS]=2 [SEP]=3 [MASK]=4, and every encoding wrapped as [CLS] ... [SEP] (queries and products
    alike). Deterministic for `texts`."""
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Lowercase(),
                                                 normalizers.StripAccents()])
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # The trainer numbers the "##c" tokens in hash-map order and breaks ties between equally
    # frequent merges by those numbers, so the same text gives a different vocabulary on every run
    # (huggingface/tokenizers#1794). Declaring them up front, sorted, fixes their ids; they are
    # removed from the special (never-split) tokens afterwards and stay ordinary vocabulary.
    seeded = _continuing_subword_tokens(tokenizer, texts)
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS) + seeded,
                                        show_progress=False)
    tokenizer.train_from_iterator(_word_feed(texts, max_words), trainer=trainer)
    spec = json.loads(tokenizer.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in SPECIAL_TOKENS]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS))), f"special token ids {ids}"
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids[2]), ("[SEP]", ids[3])])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    if not path.is_file():
        raise BadInputError(f"tokenizer {path} not found; run `python -m pipeline_steps prepare` for this run dir")
    return Tokenizer.from_file(str(path))


ENCODE_CHUNK = 8192
"""Distinct texts encoded per call: the tokenizer's Encoding objects (ids, tokens, masks) cost
~100x the int32 row they become, so encoding a whole catalog at once peaks at gigabytes."""


def distinct_texts(texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[list[str], np.ndarray]:
    """(the distinct texts in order of first appearance, int64 [n]: each text's index in them),
    by Arrow's hash table instead of a Python dict."""
    array = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.string())
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    encoded = pc.dictionary_encode(array)
    return encoded.dictionary.to_pylist(), encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)


ENCODE_CACHE_TEXTS = 1 << 18
"""Distinct texts a TextEncoder remembers (their rows: 32 MB at 32 tokens). Queries repeat
across the chunks of a click log: each is encoded once, not once per chunk."""


class TextEncoder:
    """`encode_texts` that remembers the rows of up to `capacity` texts across calls (the first
    ones seen; a text's row does not depend on the call, so the result is the same)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int, capacity: int = ENCODE_CACHE_TEXTS,
                 word_capacity: int | None = None):
        """`capacity` texts remembered, and `word_capacity` words by its word encoder (its default)."""
        # A private copy: truncation is tokenizer state and the caller's object stays untouched.
        self._tok = Tokenizer.from_str(tokenizer.to_str())
        self._tok.enable_truncation(max_length=max_length)
        self._tok.no_padding()  # padding here is cheaper than turning 0s into Python ints and back
        self._words = WordEncoder.of(tokenizer, max_length)
        if self._words is not None and word_capacity is not None:
            self._words.capacity = word_capacity
        self.max_length, self.capacity = max_length, capacity
        self._row: dict[str, int] = {}
        self._ids = np.zeros((0, max_length), dtype=np.int32)
        self._lengths = np.zeros(0, dtype=np.int32)

    def __call__(self, texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids int32 [n, max_length], lengths int32 [n] = real tokens incl. specials)."""
        # Each distinct text is encoded once: queries repeat across the pairs of a click log.
        distinct, inverse = distinct_texts(texts)
        known = np.fromiter((self._row.get(t, -1) for t in distinct), dtype=np.int64, count=len(distinct))
        missing = np.flatnonzero(known < 0)
        new_ids, new_lengths = self._encode([distinct[i] for i in missing])
        ids = np.empty((len(distinct), self.max_length), dtype=np.int32)
        lengths = np.empty(len(distinct), dtype=np.int32)
        cached = np.flatnonzero(known >= 0)
        ids[cached], lengths[cached] = self._ids[known[cached]], self._lengths[known[cached]]
        ids[missing], lengths[missing] = new_ids, new_lengths
        self._remember([distinct[i] for i in missing], new_ids, new_lengths)
        return ids[inverse], lengths[inverse]

    def _remember(self, texts: list[str], ids: np.ndarray, lengths: np.ndarray) -> None:
        room = min(len(texts), self.capacity - len(self._row))
        if room <= 0:
            return
        start = len(self._row)
        self._row.update(zip(texts[:room], range(start, start + room)))
        self._ids = np.concatenate([self._ids, ids[:room]])
        self._lengths = np.concatenate([self._lengths, lengths[:room]])

    def _encode(self, distinct: list[str]) -> tuple[np.ndarray, np.ndarray]:
        if self._words is not None:
            return self._words(distinct)
        return _encode_rows(self._tok, distinct, self.max_length)


def _encode_flat(tok: Tokenizer, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [total] of every text one after the other, lengths int32 [n]) of `texts` as `tok`
    encodes them (its truncation included), ENCODE_CHUNK texts per call."""
    flats, lengths = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int32)]
    for start in range(0, len(texts), ENCODE_CHUNK):
        encodings = tok.encode_batch_fast(texts[start:start + ENCODE_CHUNK])  # no character offsets
        id_lists = [e.ids for e in encodings]  # each .ids builds a new Python list: once per encoding
        lengths.append(np.fromiter(map(len, id_lists), dtype=np.int32, count=len(id_lists)))
        flats.append(np.fromiter(itertools.chain.from_iterable(id_lists), dtype=np.int32, count=int(lengths[-1].sum())))
    return np.concatenate(flats), np.concatenate(lengths)


def _encode_rows(tok: Tokenizer, texts: Sequence[str], width: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n, width] 0-padded, lengths int32 [n]) of `texts` as `tok` encodes them (its
    truncation included)."""
    flat, lengths = _encode_flat(tok, texts)
    ids = np.zeros((len(texts), width), dtype=np.int32)
    rows = np.repeat(np.arange(len(texts)), lengths)
    ids[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)] = flat
    return ids, lengths


ENCODE_WORDS = 4096
"""Distinct words encoded as one text by WordEncoder."""
WORD_CHUNK_BYTES = 1 << 22
"""Bytes of text split into words at a time (bounds the word arrays: ~100 bytes per word)."""
WORD_CACHE_WORDS = 1 << 19
"""Distinct words a WordEncoder remembers the tokens of (~150 bytes each): the words of a catalog
repeat across its chunks and calls, so each is tokenised once, not once per chunk."""
_SPACE_SAFE_NORMALIZERS = frozenset({"NFD", "Lowercase", "StripAccents", "BertNormalizer"})
"""Normalizers that map each character on its own (NFD reorders only combining marks, which a
space separates), so a space stays a space and nothing crosses it."""


class WordEncoder:
    """`encode_texts` by words: the tokens of a text are the tokens of its space-separated words
    in order, so each distinct word is tokenised once and the rows are assembled with numpy. Exact
    for the tokenizers `of` accepts: every stage treats a space as a boundary (normalizers that
    map characters one by one, the BERT pre-tokenizer that splits at whitespace, WordPiece per
    word, added tokens without spaces or stripping), and the post-processor wraps a text in one
    token before and one after ([CLS] ... [SEP]). The tokens of the first `capacity` distinct
    words are remembered across chunks and calls (a word's tokens do not depend on its text)."""

    def __init__(self, inner: Tokenizer, max_length: int, first: int, last: int, capacity: int = WORD_CACHE_WORDS):
        self._inner, self.max_length, self.first, self.last = inner, max_length, first, last
        self.capacity = capacity
        self._slot: dict[str, int] = {}  # word -> its index in _start / _count
        self._tokens = np.zeros(0, dtype=np.int32)  # the remembered words' tokens, one after the other
        self._start = np.zeros(0, dtype=np.int64)
        self._count = np.zeros(0, dtype=np.int64)

    @classmethod
    def of(cls, tokenizer: Tokenizer, max_length: int) -> WordEncoder | None:
        """The word encoder of `tokenizer`, None when its output could differ from encoding whole texts."""
        spec = json.loads(tokenizer.to_str())
        normalizer = spec.get("normalizer") or {"type": "Sequence", "normalizers": []}
        steps = normalizer.get("normalizers", []) if normalizer["type"] == "Sequence" else [normalizer]
        post = spec.get("post_processor") or {}
        single = post.get("single", [])
        if (max_length <= 2 or any(step.get("type") not in _SPACE_SAFE_NORMALIZERS for step in steps)
                or (spec.get("pre_tokenizer") or {}).get("type") != "BertPreTokenizer"
                or spec["model"].get("type") != "WordPiece"
                or any(t["lstrip"] or t["rstrip"] or t["single_word"] or any(c.isspace() for c in t["content"])
                       for t in spec.get("added_tokens", []))
                or post.get("type") != "TemplateProcessing"
                or [next(iter(part)) for part in single] != ["SpecialToken", "Sequence", "SpecialToken"]):
            return None
        first, last = (post["special_tokens"][single[k]["SpecialToken"]["id"]]["ids"] for k in (0, 2))
        if len(first) != 1 or len(last) != 1:
            return None
        # The words' own tokens, without [CLS]/[SEP].
        spec.update(post_processor=None, truncation=None, padding=None)
        return cls(Tokenizer.from_str(json.dumps(spec)), max_length, first[0], last[0])

    def __call__(self, texts: Sequence[str] | pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
        """(token_ids int32 [n, max_length], lengths int32 [n]), as encode_texts."""
        array = texts if isinstance(texts, (pa.Array, pa.ChunkedArray)) else pa.array(texts, pa.string())
        ids = np.zeros((len(array), self.max_length), dtype=np.int32)
        lengths = np.zeros(len(array), dtype=np.int32)
        ends = np.cumsum(pc.binary_length(array).to_numpy(zero_copy_only=False).astype(np.int64) + 1)
        start = 0
        while start < len(array):
            # At least one text per chunk; then as many as fit in WORD_CHUNK_BYTES.
            before = ends[start - 1] if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, before + WORD_CHUNK_BYTES, side="right")))
            chunk = array.slice(start, stop - start)
            self._fill(chunk.combine_chunks() if isinstance(chunk, pa.ChunkedArray) else chunk,
                       ids[start:stop], lengths[start:stop])
            start = stop
        return ids, lengths

    def _words(self, distinct: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, start, count): the tokens of `distinct`[k] are tokens[start[k]:start[k] + count[k]].
        Remembered words are looked up; the others are tokenised, and remembered while there is room."""
        slot = np.fromiter((self._slot.get(w, -1) for w in distinct), dtype=np.int64, count=len(distinct))
        new = np.flatnonzero(slot < 0)
        tokens, start, count = self._tokens, self._start, self._count
        if len(new):
            words = [distinct[i] for i in new]
            flat, lengths = self._encode_words(words)
            slot[new] = len(start) + np.arange(len(new))
            start = np.concatenate([start, len(tokens) + np.cumsum(lengths, dtype=np.int64) - lengths])
            count = np.concatenate([count, lengths.astype(np.int64)])
            tokens = np.concatenate([tokens, flat])
            keep = len(self._start) + min(len(new), self.capacity - len(self._slot))
            if keep > len(self._start):
                self._slot.update(zip(words, range(len(self._start), keep)))
                self._start, self._count = start[:keep], count[:keep]
                self._tokens = tokens[:int(start[keep - 1] + count[keep - 1])]
        return tokens, start[slot], count[slot]

    def _encode_words(self, words: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32 of every word's tokens one after the other, count int32 [n]), each word cut at
        the room a text leaves for its tokens. ENCODE_WORDS words are joined by spaces into one text
        per encoding (one Encoding per word costs more than its tokens); the words of a token are
        found from its character offset, inside its word's span of the joined text."""
        room = self.max_length - 2
        batches = [words[i:i + ENCODE_WORDS] for i in range(0, len(words), ENCODE_WORDS)]
        flats, counts = [np.zeros(0, dtype=np.int32)], [np.zeros(0, dtype=np.int32)]
        for batch, encoding in zip(batches, self._inner.encode_batch([" ".join(b) for b in batches],
                                                                     add_special_tokens=False)):
            ids = np.array(encoding.ids, dtype=np.int32)
            spans = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch)) + 1
            offsets = np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)[:, 0]
            word = np.searchsorted(np.cumsum(spans) - spans, offsets, side="right") - 1
            count = np.bincount(word, minlength=len(batch))
            within = np.arange(len(word)) - (np.cumsum(count) - count)[word]
            flats.append(ids[within < room])
            counts.append(np.minimum(count, room).astype(np.int32))
        return np.concatenate(flats), np.concatenate(counts)

    def _fill(self, texts: pa.Array, ids: np.ndarray, lengths: np.ndarray, whole: bool = False) -> None:
        room = self.max_length - 2
        # A word has at least one token (but for rare words, such as a lone accent the normalizer
        # drops), so a text's first `room` words fill its row: a long description is split no further.
        # A text with more words whose first `room` do not fill it is encoded again `whole`, below.
        words = pc.split_pattern(texts, " ", max_splits=None if whole else room)  # "" -> [""]: a word per text
        per_text = pc.list_value_length(words).to_numpy(zero_copy_only=False).astype(np.int64)
        more = (per_text > room) & (not whole)
        if more.any():
            words, per_text = pc.list_slice(words, 0, room), np.minimum(per_text, room)
        distinct, word = distinct_texts(pc.list_flatten(words))
        tokens, word_start, word_count = self._words(distinct)
        # One entry per word occurrence: where its first token lands in its text.
        occurrence_tokens = word_count[word]
        text_of = np.repeat(np.arange(len(texts)), per_text)
        ends = np.cumsum(occurrence_tokens)
        starts = ends - occurrence_tokens
        first_occurrence = np.cumsum(per_text) - per_text
        text_start = starts[first_occurrence]
        position = starts - text_start[text_of]
        tokens_per_text = ends[first_occurrence + per_text - 1] - text_start
        lengths[:] = np.minimum(tokens_per_text, room) + 2
        # Then one entry per token that fits: truncation drops the rest before it costs anything.
        inside = np.flatnonzero(position < room)
        fits = np.minimum(occurrence_tokens[inside], room - position[inside])
        token_of = np.repeat(inside, fits)
        within = np.arange(len(token_of)) - np.repeat(np.cumsum(fits) - fits, fits)
        ids[text_of[token_of], position[token_of] + within + 1] = tokens[word_start[word[token_of]] + within]
        ids[:, 0] = self.first
        ids[np.arange(len(texts)), lengths - 1] = self.last
        short = np.flatnonzero(more & (tokens_per_text < room))
        if len(short):
            again_ids, again_lengths = np.zeros((len(short), self.max_length), dtype=np.int32), np.zeros_like(short)
            self._fill(texts.take(pa.array(short)), again_ids, again_lengths, whole=True)
            ids[short], lengths[short] = again_ids, again_lengths


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str] | pa.Array | pa.ChunkedArray,
                 max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Encode `texts` as [CLS] ... [SEP], truncated (keeping [SEP]) and padded with 0 to `max_length`.
    Returns (token_ids int32 [n, max_length], lengths int32 [n] = real tokens incl. specials).
    By words when the tokenizer allows (no pass over the distinct texts: a catalog's texts hardly
    repeat, and that pass would hold a second copy of them)."""
    words = WordEncoder.of(tokenizer, max_length)
    return words(texts) if words is not None else TextEncoder(tokenizer, max_length, capacity=0)(texts)


def normalise_query(text: str) -> str:
    """The form two queries must share to count as the same query: NFKD, accents dropped,
    lowercase, single spaces."""
    if text.isascii():  # nothing to decompose or drop: the common case, 5x faster
        return " ".join(text.lower().split())
    stripped = unicodedata.normalize("NFKD", text).translate(_COMBINING_MARKS)
    return " ".join(stripped.lower().split())


class _CombiningMarks(dict):
    """A str.translate table that drops combining marks (accents), filled one code point at a time
    as texts meet them: a translate runs in C, a per-character Python loop took most of the time of
    the holdout split of non-ASCII queries."""

    def __missing__(self, code: int) -> int | None:
        self[code] = None if unicodedata.combining(chr(code)) else code
        return self[code]


_COMBINING_MARKS = _CombiningMarks()


def query_keys(queries: Sequence[str], seed: int, cache: dict[str, int] | None = None) -> np.ndarray:
    """uint64 [n]: a hash of (seed, normalised query): equal for the same query, whatever its case,
    accents or spacing. It decides the holdout split and counts distinct queries. `cache`: the keys
    of queries seen in earlier calls with the same seed (filled here, and emptied once it holds
    ENCODE_CACHE_TEXTS queries, so its memory stays bounded), when the caller keeps one."""
    distinct, inverse = distinct_texts(queries)  # a query repeats across many pairs (clicks, purchases)
    cache = {} if cache is None else cache
    if len(cache) > ENCODE_CACHE_TEXTS:
        cache.clear()
    found = list(map(cache.get, distinct))
    missing = [i for i, key in enumerate(found) if key is None]
    if missing:
        new = [distinct[i] for i in missing]
        keys = text_hashes([f"{seed}\x00{normalise_query(query)}" for query in new]).tolist()
        cache.update(zip(new, keys))
        for i, key in zip(missing, keys):
            found[i] = key
    return np.array(found, dtype=np.uint64)[inverse]


def holdout_threshold(fraction: float) -> np.uint64:
    return np.uint64(int(fraction * 2**64))


def holdout_mask(queries: Sequence[str], fraction: float, seed: int) -> np.ndarray:
    """bool [n]: True for pairs whose query is held out. Decided by a hash of (seed, normalised
    query), so every pair of one query lands on the same side, and a query keeps its side in the
    next data version (incremental runs are validated on queries they never trained on)."""
    return query_keys(queries, seed) < holdout_threshold(fraction)


class TextSample:
    """At most `size` distinct texts: those with the smallest hashes, and of those the first that fit
    in `max_chars` characters. The same sample whatever the order the texts arrive in or how the
    input is sharded, in bounded memory."""

    def __init__(self, size: int, max_chars: int | None = None):
        self.size, self.max_chars = size, max_chars
        self._hashes = np.zeros(0, dtype=np.uint64)  # of the kept texts, in the order of _texts
        self._texts = np.empty(0, dtype=object)
        self._kept: set[str] = set()

    def update(self, texts: Iterable[str]) -> None:
        new = list(set(texts) - self._kept)
        self._add(new, text_hashes(new))

    def merge(self, other: TextSample) -> None:
        """Add the sample of another part of the input: the result is the sample of both parts."""
        new = [k for k, text in enumerate(other._texts.tolist()) if text not in self._kept]
        self._add(other._texts[new].tolist(), other._hashes[new])

    def _add(self, new: list[str], hashes: np.ndarray) -> None:
        if len(self._hashes) >= self.size:  # only a hash below the largest kept one can enter
            below = np.flatnonzero(hashes < self._hashes.max())
            new, hashes = [new[i] for i in below], hashes[below]
        if not new:
            return
        # The `size` smallest of the kept and the new hashes, found by numpy; the kept texts stay
        # in arrays, so an update costs the new texts, not a rebuild of the whole sample in Python.
        every = np.concatenate([self._hashes, hashes])
        texts = np.concatenate([self._texts, np.array(new, dtype=object)])
        if len(every) > self.size:
            keep = np.argpartition(every, self.size - 1)[:self.size]
            every, texts = every[keep], texts[keep]
            self._kept = set(texts.tolist())
        else:
            self._kept.update(new)
        self._hashes, self._texts = every, texts

    def texts(self) -> list[str]:
        """The sample, in hash order (deterministic), cut at `max_chars` characters."""
        ordered = [text for _, text in sorted(zip([-h for h in self._hashes.tolist()], self._texts.tolist()),
                                              reverse=True)]
        if self.max_chars is not None:
            fit = np.cumsum(np.fromiter(map(len, ordered), dtype=np.int64, count=len(ordered))) <= self.max_chars
            ordered = ordered[:int(fit.sum())]
        return ordered


def text_hashes(texts: Sequence[str]) -> np.ndarray:
    """uint64 [n]: the first 8 bytes of each text's blake2b digest, big-endian."""
    digests = b"".join([hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest() for text in texts])
    return np.frombuffer(digests, dtype=">u8").astype(np.uint64)
