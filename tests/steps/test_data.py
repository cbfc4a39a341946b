"""The data layer (record_reading, record_validation, tokenization, feature_schema, prepared_data,
static_batches): static-shape batches, sharding, determinism, inference batches, encoding, schema."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline_contract import PREPARED_DIR
from pipeline_steps import (
    feature_schema,
    prepared_data,
    record_reading,
    record_validation,
    static_batches,
    tokenization,
)
from pipeline_steps.errors import BadInputError
from pipeline_steps.steps.prepare import main as prepare_main


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> prepared_data.PreparedData:
    run_dir = tmp_path_factory.mktemp("run")
    assert prepare_main(["--run-dir", str(run_dir), "--demo", "--preset", "tiny"]) == 0
    return prepared_data.load_prepared(run_dir)


def _pair_multiset(pairs: prepared_data.Pairs) -> Counter:
    return Counter((tuple(ids), int(p)) for ids, p in zip(pairs.token_ids.astype(np.int64), pairs.product_index))


def _batch_multiset(batches) -> Counter:
    seen = Counter()
    for b in batches:
        real = b["row_mask"].numpy() > 0
        for ids, p in zip(b["query_ids"].numpy()[real], b["product_index"].numpy()[real]):
            seen[(tuple(ids), int(p))] += 1
    return seen


def test_every_batch_has_a_static_shape_and_padding_rows_are_masked(prepared):
    cfg = prepared.data_cfg
    batches = static_batches.TrainBatches(prepared, cfg.batch_size, rank=0, world_size=1, seed=0)
    epoch = list(batches.epoch(0))
    assert len(epoch) == batches.num_batches()
    num_partial = 0
    for b in epoch:
        B = cfg.batch_size
        assert b["query_ids"].shape == b["query_mask"].shape == (B, cfg.query_length)
        assert b["doc_ids"].shape[0] == B and b["doc_ids"].shape[1] in cfg.length_buckets
        assert b["doc_mask"].shape == b["doc_ids"].shape
        assert b["numeric"].shape == (B, len(prepared.schema.numeric_names))
        assert b["categorical"].shape == (B, len(prepared.schema.categorical_names))
        for key in ("row_mask", "weight", "class_id", "product_index"):
            assert b[key].shape == (B,)
        pad = b["row_mask"].numpy() == 0
        num_partial += bool(pad.any())
        assert (b["query_mask"].numpy()[pad] == 0).all() and (b["doc_mask"].numpy()[pad] == 0).all()
        assert (b["weight"].numpy()[pad] == 0).all() and (b["product_index"].numpy()[pad] == -1).all()
        assert (b["class_id"].numpy()[pad] == feature_schema.IGNORE_INDEX).all()
        assert (b["query_mask"].numpy()[~pad, 0] == 1).all() and (b["doc_mask"].numpy()[~pad, 0] == 1).all()
    # The last partial batch of each bucket is padded, not dropped: every real pair is there once.
    assert num_partial >= 1
    assert _batch_multiset(epoch) == _pair_multiset(prepared.train)


def test_a_pair_uses_the_smallest_bucket_that_holds_its_product(prepared):
    batches = static_batches.TrainBatches(prepared, prepared.data_cfg.batch_size, rank=0, world_size=1, seed=0)
    buckets = prepared.data_cfg.length_buckets
    widths = set()
    for b in batches.epoch(0):
        real = b["row_mask"].numpy() > 0
        lengths = prepared.products.lengths[b["product_index"].numpy()[real]]
        width = b["doc_ids"].shape[1]
        widths.add(width)
        assert (b["doc_mask"].numpy()[real].sum(axis=1) == np.minimum(lengths, width)).all()
        assert (static_batches.bucket_index(lengths, buckets) == buckets.index(width)).all()
    assert widths == set(buckets)  # the demo data fills both tiny buckets
    firsts = batches.first_batch_per_bucket()
    assert [f["doc_ids"].shape[1] for f in firsts] == list(buckets)
    assert all(f["row_mask"].sum() > 0 for f in firsts)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_step_together_and_cover_every_pair_once(prepared, world_size):
    B = prepared.data_cfg.batch_size
    ranks = [static_batches.TrainBatches(prepared, B, rank=r, world_size=world_size, seed=3) for r in range(world_size)]
    epochs = [list(r.epoch(1)) for r in ranks]
    assert len({len(e) for e in epochs}) == 1 and len(epochs[0]) == ranks[0].num_batches()
    # One bucket per step on every rank: the same graph everywhere, no rank waits for a longer one.
    widths = [[b["doc_ids"].shape[1] for b in e] for e in epochs]
    assert all(w == widths[0] for w in widths) and len(set(widths[0])) > 1
    everything = [b for e in epochs for b in e]
    assert _batch_multiset(everything) == _pair_multiset(prepared.train)
    # Ranks must not overlap: rank 0 alone sees only its share.
    assert sum(_batch_multiset(epochs[0]).values()) < len(prepared.train)


def test_order_is_fixed_by_seed_and_epoch_and_start_resumes(prepared):
    B = prepared.data_cfg.batch_size

    def product_order(seed, epoch, start=0):
        batches = static_batches.TrainBatches(prepared, B, rank=0, world_size=1, seed=seed)
        return [tuple(b["product_index"].tolist()) for b in batches.epoch(epoch, start=start)]

    assert product_order(0, 0) == product_order(0, 0)
    assert product_order(0, 0) != product_order(0, 1)
    assert product_order(0, 0) != product_order(1, 0)
    assert product_order(0, 2, start=5) == product_order(0, 2)[5:]


def test_no_pairs_means_no_batches(prepared):
    empty = prepared_data.Pairs(queries=[], token_ids=np.zeros((0, prepared.data_cfg.query_length), np.int32),
                    lengths=np.zeros(0, np.int32), product_index=np.zeros(0, np.int64),
                    weight=np.zeros(0, np.float32), class_id=np.zeros(0, np.int64))
    data = prepared_data.PreparedData(prepared.products, empty, empty, prepared.schema, prepared.tokenizer_path,
                          prepared.data_cfg)
    batches = static_batches.TrainBatches(data, 4, rank=0, world_size=2, seed=0)
    assert batches.num_batches() == 0 and list(batches.epoch(0)) == []


def test_text_batches_cover_every_index_exactly_once(prepared):
    products = prepared.products
    buckets = prepared.data_cfg.length_buckets
    seen = []
    for indices, ids, mask, n_real in static_batches.text_batches(products.token_ids, products.lengths, 7, buckets):
        assert indices.shape == (7,) and ids.shape == mask.shape and ids.shape[0] == 7 and ids.shape[1] in buckets
        real = indices >= 0
        assert n_real == real.sum() and real[:n_real].all()  # padding rows only at the end
        assert (mask[~real] == 0).all()
        width = ids.shape[1]
        assert (mask[real].sum(axis=1) == np.minimum(products.lengths[indices[real]], width)).all()
        assert (ids[real] == products.token_ids[indices[real], :width] * mask[real]).all()
        seen.extend(indices[real].tolist())
    assert sorted(seen) == list(range(len(products)))


def test_encode_texts_wraps_truncates_and_pads(prepared):
    tokenizer = tokenization.load_tokenizer(prepared.tokenizer_path)
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    ids, lengths = tokenization.encode_texts(tokenizer, ["grey sofa", "grey sofa " * 50], 8)
    assert ids.dtype == np.int32 and ids.shape == (2, 8) and lengths.tolist()[1] == 8
    assert ids[0, 0] == cls and ids[0, lengths[0] - 1] == sep and (ids[0, lengths[0]:] == record_reading.PAD_ID).all()
    assert ids[1, 0] == cls and ids[1, 7] == sep  # truncation keeps the closing [SEP]
    assert tokenizer.truncation is None and tokenizer.padding is None  # the caller's tokenizer is untouched
    # lowercase + strip accents: the same ids for differently written text
    a, _ = tokenization.encode_texts(tokenizer, ["CAFE Creme"], 8)
    b, _ = tokenization.encode_texts(tokenizer, ["caf\u00e9 cr\u00e8me"], 8)
    assert (a == b).all()
    assert [tokenizer.id_to_token(i) for i in range(5)] == list(tokenization.SPECIAL_TOKENS)


def test_tokenizer_training_is_deterministic(prepared):
    texts = list(prepared.products.texts) + list(prepared.train.queries)
    first = tokenization.train_tokenizer(texts, prepared.data_cfg.vocab_size)
    assert all(tokenization.train_tokenizer(texts, prepared.data_cfg.vocab_size).to_str() == first.to_str() for _ in range(3))
    # "##" pieces are ordinary vocabulary, not special tokens that would split the input text.
    assert first.encode("##a").tokens[:2] == ["[CLS]", "[UNK]"]


def test_schema_round_trips_and_maps_unseen_values_to_unknown(tmp_path):
    products = [record_validation.ProductRecord(id="a", title="x", numeric={"price": 10.0}, categorical={"colour": "red"},
                                category="c1"),
                record_validation.ProductRecord(id="b", title="y", numeric={"price": 30.0}, categorical={"colour": "blue"},
                                category="c2")]
    schema = feature_schema.Schema.fit(products)
    schema.save(tmp_path / "schema.json")
    assert feature_schema.Schema.load(tmp_path / "schema.json") == schema
    assert feature_schema.Schema.from_dict(dict(schema.to_dict())) == schema
    assert schema.cardinalities == (3,)
    new = [record_validation.ProductRecord(id="c", title="z", categorical={"colour": "green"}),
           record_validation.ProductRecord(id="d", title="w", numeric={"price": 30.0}, categorical={"colour": "red"})]
    assert schema.categorical_matrix(new).tolist() == [[0], [2]]
    assert schema.numeric_matrix(new)[:, 0].tolist() == [0.0, 1.0]  # missing -> mean; (30-20)/10
    assert schema.class_ids(["c2", "c9", None]).tolist() == [1, feature_schema.IGNORE_INDEX, feature_schema.IGNORE_INDEX]


def test_load_prepared_without_prepare_says_what_to_run(tmp_path):
    with pytest.raises(BadInputError, match="pipeline_steps prepare"):
        prepared_data.load_prepared(tmp_path)


def test_prepared_arrays_round_trip_through_parquet(prepared, tmp_path):
    path = tmp_path / "p.parquet"
    prepared_data.save_pairs(path, prepared.train, prepared.products.ids)
    again = prepared_data.read_pairs(path, prepared.data_cfg)
    assert again.queries == prepared.train.queries
    for name in ("token_ids", "lengths", "product_index", "weight", "class_id"):
        assert np.array_equal(getattr(again, name), getattr(prepared.train, name))
    assert Path(prepared.tokenizer_path).is_file()


def test_a_list_column_past_the_int32_offsets_holds_every_row():
    """A token_ids column of 2^16 + 1 rows x 2^15 tokens (more values than a list array's int32
    offsets can index; a catalog of 17 million products at 128 tokens has as many) is built in
    chunks with every row intact. The zeros are pages the kernel has not backed: no memory used."""
    matrix = np.zeros((2**16 + 1, 2**15), dtype=np.int8)
    matrix[-1] = np.arange(2**15) % 101
    column = prepared_data._list_column(matrix)
    assert len(column) == 2**16 + 1
    assert column[-1].as_py() == matrix[-1].tolist()
    assert column[2**16 - 1].as_py() == [0] * 2**15


def test_training_pairs_are_memory_mapped_not_copied_per_rank(prepared, tmp_path_factory):
    """Every rank of a node maps the same .npy files (one copy in the page cache) instead of
    decoding its own copy of the Parquet file; the values are the Parquet file's."""
    run_dir = Path(prepared.tokenizer_path).parents[1]
    parquet = prepared_data.read_pairs(run_dir / PREPARED_DIR / "train_pairs.parquet", prepared.data_cfg)
    for name in prepared_data.PAIR_ARRAYS:
        mapped = getattr(prepared.train, name)
        assert isinstance(mapped, np.memmap) and not mapped.flags.writeable, name
        assert np.array_equal(mapped, getattr(parquet, name)), name
    assert list(prepared.train.queries) == parquet.queries and len(prepared.train) == len(parquet)


def test_every_rank_memory_maps_the_catalog_instead_of_copying_it(prepared):
    """The catalog's arrays are file-backed and read-only: the ranks of a node share one copy in
    the page cache (RSS per rank does not grow with the catalog or the number of ranks)."""
    run_dir = Path(prepared.tokenizer_path).parents[1]
    products = prepared_data.load_prepared(run_dir).products
    from_parquet = prepared_data.read_products(run_dir / PREPARED_DIR / "products.parquet", prepared.data_cfg, prepared.schema)
    for name in prepared_data.PRODUCT_ARRAYS:
        array = getattr(products, name)
        assert isinstance(array, np.memmap) and not array.flags.writeable, name
        np.testing.assert_array_equal(array, getattr(from_parquet, name))
    assert list(products.ids) == from_parquet.ids and list(products.texts) == from_parquet.texts
    assert len(products) == len(from_parquet.ids)


@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(codec="utf-8"), max_size=80)
       | st.text(st.sampled_from("ab ~!\t\n\x0b\x1c\x1f\x7f\u00a0\u00e9"), max_size=300))
def test_collapsing_spaces_is_splitting_and_joining(text):
    """Texts are whitespace-collapsed as str.split() and a join give them; the shortcut for long
    texts that need nothing (most descriptions) changes no text."""
    assert record_validation.collapse_spaces(text) == " ".join(text.split())


def test_a_text_sample_keeps_the_smallest_hashes_that_fit_its_character_budget():
    """The tokenizer's sample is bounded in texts and in characters: the texts with the smallest
    hashes, in hash order, as many as fit; the same whatever order the texts arrive in."""
    texts = [f"text {i} " + "x" * (i % 13) for i in range(300)]
    unbounded = tokenization.TextSample(60)
    unbounded.update(texts)
    smallest = unbounded.texts()
    budget = sum(map(len, smallest)) // 2
    fit = [t for k, t in enumerate(smallest) if sum(map(len, smallest[:k + 1])) <= budget]
    for order in (texts, texts[::-1]):
        bounded = tokenization.TextSample(60, max_chars=budget)
        for start in range(0, len(order), 70):
            bounded.update(order[start:start + 70])
        assert bounded.texts() == fit
    assert 0 < len(fit) < len(smallest) == 60


def test_a_text_encoder_remembers_texts_across_calls_without_changing_their_rows():
    tokenizer = tokenization.train_tokenizer(["grey sofa", "oak table", "blue lamp"] * 3, 64)
    calls = [["grey sofa", "oak table", "grey sofa"], ["oak table", "blue lamp", "red chair"], ["grey sofa"]]
    for capacity in (0, 2, 100):
        encoder = tokenization.TextEncoder(tokenizer, 6, capacity=capacity)
        for texts in calls:
            got, expected = encoder(texts), tokenization.encode_texts(tokenizer, texts, 6)
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
        assert len(encoder._row) == min(capacity, 4)


_AWKWARD = ["grey", "Sofa", " ", "  ", "\t", "\n", "\u00a0", "\u2003", "\x1c", "caf\u00e9", "e\u0301", "\u0301", "\u03a3",
            "\u0130", "\ufb01", "\u65e5\u672c", ".", ",!", "-", "[CLS]", "[SEP]", "[MASK]", "[", "CLS]", "x" * 120]


def _word_test_tokenizer(bert_normalizer: bool):
    from tokenizers import Tokenizer, normalizers

    tokenizer = tokenization.train_tokenizer(["grey sofa", "caf\u00e9 cr\u00e8me", "oak table, blue lamp!"] * 3, 80)
    if bert_normalizer:  # what a Hugging Face BERT tokenizer.json (--pretrained) uses
        tokenizer = Tokenizer.from_str(tokenizer.to_str())
        tokenizer.normalizer = normalizers.BertNormalizer()
    return tokenizer


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from(_AWKWARD), max_size=30).map("".join), min_size=1, max_size=8),
       st.sampled_from([3, 6, 12]), st.booleans())
def test_encoding_by_words_gives_the_rows_of_encoding_whole_texts(texts, max_length, bert_normalizer):
    """Tokenising each distinct space-separated word once and assembling the rows is exact:
    accents, case, punctuation, other whitespace, special-token strings and truncation included."""
    tokenizer = _word_test_tokenizer(bert_normalizer)
    encoder = tokenization.TextEncoder(tokenizer, max_length, capacity=0)
    assert encoder._words is not None
    got, expected = encoder._words(texts), tokenization._encode_rows(encoder._tok, texts, max_length)
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1], expected[1])


def test_encoding_by_words_remembers_words_across_chunks_and_calls(monkeypatch):
    """Words seen in an earlier chunk or call keep their tokens (up to the cache's capacity), and
    the rows stay those of encoding whole texts, whatever the chunking."""
    monkeypatch.setattr(tokenization, "WORD_CHUNK_BYTES", 24)  # a few texts per chunk
    monkeypatch.setattr(tokenization, "ENCODE_WORDS", 3)  # several encodings of joined words per chunk
    tokenizer = _word_test_tokenizer(bert_normalizer=False)
    texts = ["grey sofa", "caf\u00e9 cr\u00e8me, oak table", "grey oak", "blue lamp! grey sofa", "",
             " ".join(["oak"] * 30), "x" * 120, "[CLS] sofa  \u00a0grey",
             " ".join(["\u0301"] * 9 + ["grey", "sofa"])]  # the first words have no token: read on
    whole = tokenization.TextEncoder(tokenizer, 8, capacity=0)._tok
    for capacity in (0, 3, 1000):
        words = tokenization.WordEncoder.of(tokenizer, 8)
        words.capacity = capacity
        for call in (texts, texts[::-1], texts[2:5]):
            got, expected = words(call), tokenization._encode_rows(whole, call, 8)
            np.testing.assert_array_equal(got[0], expected[0])
            np.testing.assert_array_equal(got[1], expected[1])
        assert len(words._slot) == min(capacity, len({w for text in texts for w in text.split(" ")}))


def test_a_tokenizer_whose_words_can_span_spaces_is_encoded_whole():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = tokenization.train_tokenizer(["grey sofa", "oak table"] * 3, 64)
    assert tokenization.WordEncoder.of(tokenizer, 8) is not None
    metaspace = Tokenizer.from_str(tokenizer.to_str())
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace()  # "\u2581word": the space belongs to the token
    assert tokenization.WordEncoder.of(metaspace, 8) is None
    assert tokenization.WordEncoder.of(Tokenizer(models.WordPiece(unk_token="[UNK]")), 8) is None  # no [CLS] ... [SEP]


def test_query_keys_cache_stays_bounded_and_keys_stay_equal(monkeypatch):
    monkeypatch.setattr(tokenization, "ENCODE_CACHE_TEXTS", 4)
    cache: dict[str, int] = {}
    queries = [f"query {i}" for i in range(10)]
    keys = np.concatenate([tokenization.query_keys(queries[i:i + 3], 7, cache) for i in range(0, 10, 3)])
    assert len(cache) <= 4 + 3  # emptied once past the bound, then one call's queries added
    np.testing.assert_array_equal(keys, tokenization.query_keys(queries, 7))
