"""Text in and out: a thin wrapper over the `tokenizers` package.

One loader for the frontend (launch/, which re-exports it as launch.tokenizer) and for the ranks'
grammar matchers (workers/sample/grammar.py), so both see one token table. It lives in workers/
because launch/ may import workers/, never the other way round.

Two sources are supported: a Hugging Face directory (tokenizer.json + tokenizer_config.json) and a
.gguf file, whose metadata carries the whole vocabulary, the BPE merges and the chat template.
Chat templates are rendered in a jinja2 *sandbox*: they come from downloaded files, so they must
not be able to reach Python objects or run code.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from workers.model.paths import DUMMY_PREFIX, resolve_model

__all__ = ["Tokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

# GGUF token_type values (llama.cpp's llama_token_type).
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4
_SPM_SPACE = "\u2581"  # SentencePiece's visible space

# llama.cpp names each model family's pre-tokenizer; the ones below are not plain GPT-2 regexes.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """Encode / decode / chat-template for one model. Build it with `load_tokenizer`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        vocab_size: int,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        chat_template: str | None = None,
    ) -> None:
        self._backend = backend
        self.vocab_size = vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token and bos_token_id is not None
        self.chat_template = chat_template
        self.has_chat_template = bool(chat_template)
        self._compiled_template: Any = None  # jinja2 Template, compiled on first use

    @property
    def backend(self) -> BackendTokenizer:
        return self._backend

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token text (e.g. "<|im_start|>") becomes single ids.

        BOS is prepended only when the model asks for it and the text (a chat template may
        already write it) does not start with it, so a templated prompt never gets two.
        """
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, user_message: str, system: str | None = None) -> str:
        """The prompt text for one user turn (plus optional system turn), ending with the
        generation prompt so the model answers as the assistant."""
        messages = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": user_message})
        return self.render_chat(messages)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for a whole conversation (OpenAI-style role/content dicts)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send the prompt raw instead")
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template)
        return self._compiled_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_token_id),
            eos_token=self._token_text(self.eos_token_id),
        )

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._backend.id_to_token(token_id) or ""


def _compile_template(source: str) -> Any:
    """Compile a chat template in an immutable sandbox, with the helpers HF templates expect."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(value: Any, indent: int | None = None) -> str:
        # jinja2's own tojson HTML-escapes; templates want plain JSON.
        return json.dumps(value, ensure_ascii=False, indent=indent)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# ----------------------------------------------------------------------------- loading


def load_tokenizer(model: str) -> Tokenizer | None:
    """Tokenizer for a model name as the engine takes it.

    None for dummy:* models and for a Hugging Face directory without tokenizer.json (such
    models take token-id prompts only). Raises ValueError for unknown names or formats.
    """
    if model.startswith(DUMMY_PREFIX):
        return None
    # A bare tokenizer directory (no config.json) is fine here; the loader needs more.
    path = model if os.path.isdir(model) else resolve_model(model)
    if os.path.isdir(path):
        return _load_hf_dir(path)
    stat = os.stat(path)
    return _cached_gguf_tokenizer(os.path.realpath(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _cached_gguf_tokenizer(path: str, mtime_ns: int, size: int) -> Tokenizer:
    # Parsing GGUF metadata takes seconds (~100k strings); a process that builds several LLMs
    # on one model (tests, notebooks) pays it once. mtime/size in the key catch a replaced file.
    return load_gguf_tokenizer(path)


def _load_hf_dir(path: str) -> Tokenizer | None:
    tok_file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_file):
        logger.warning("%s has no tokenizer.json: text prompts and output text are off", path)
        return None
    backend = BackendTokenizer.from_file(tok_file)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    model_config = _read_json(os.path.join(path, "config.json"))

    bos_id = _special_id(backend, config.get("bos_token"), model_config.get("bos_token_id"))
    eos_id = _special_id(backend, config.get("eos_token"), model_config.get("eos_token_id"))
    add_bos = config.get("add_bos_token")
    if add_bos is None:
        # No explicit flag: the tokenizer.json post-processor is what says it (e.g. Llama).
        with_special = backend.encode("a", add_special_tokens=True).ids
        add_bos = bos_id is not None and bool(with_special) and with_special[0] == bos_id
    return Tokenizer(
        backend,
        vocab_size=backend.get_vocab_size(with_added_tokens=True),
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        add_bos_token=bool(add_bos),
        chat_template=_hf_chat_template(path, config),
    )


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _special_id(backend: BackendTokenizer, token: Any, fallback: Any) -> int | None:
    """Id of a special token given as text or as {"content": text}; else the config's id."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        token_id = backend.token_to_id(token)
        if token_id is not None:
            return token_id
    if isinstance(fallback, list):  # config.json may list several EOS ids; the first is canonical
        fallback = fallback[0] if fallback else None
    return fallback if isinstance(fallback, int) else None


def _hf_chat_template(path: str, config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if isinstance(template, str) and template:
        return template
    jinja_file = os.path.join(path, "chat_template.jinja")  # newer HF layout
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            return f.read()
    return None


def load_gguf_tokenizer(path: str) -> Tokenizer:
    """Rebuild the model's tokenizer from GGUF metadata (byte-level or SentencePiece BPE)."""
    from gguf import GGUFReader

    fields = GGUFReader(path, "r").fields

    def scalar(name: str, default: Any = None) -> Any:
        field = fields.get(name)
        if field is None:
            return default
        part = field.parts[field.data[0]]
        if field.types and field.types[0].name == "STRING":
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    def array(name: str) -> list[Any]:
        field = fields.get(name)
        if field is None:
            return []
        if field.types[-1].name == "STRING":
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]

    kind = scalar("tokenizer.ggml.model")
    tokens = array("tokenizer.ggml.tokens")
    token_types = array("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens)
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in array("tokenizer.ggml.merges")]
        backend = build_byte_level_bpe(
            tokens,
            token_types,
            merges,  # type: ignore[arg-type]
            pre=scalar("tokenizer.ggml.pre", "default"),
            add_prefix_space=bool(scalar("tokenizer.ggml.add_space_prefix", False)),
        )
        add_bos_default = False
    elif kind == "llama":
        backend = build_sentencepiece_bpe(
            tokens,
            array("tokenizer.ggml.scores") or [0.0] * len(tokens),
            token_types,
            add_prefix_space=bool(scalar("tokenizer.ggml.add_space_prefix", True)),
        )
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ValueError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported "
            "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama' are)"
        )
    return Tokenizer(
        backend,
        vocab_size=len(tokens),
        bos_token_id=scalar("tokenizer.ggml.bos_token_id"),
        eos_token_id=scalar("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(scalar("tokenizer.ggml.add_bos_token", add_bos_default)),
        chat_template=scalar("tokenizer.chat_template"),
    )


def build_byte_level_bpe(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[tuple[str, str]],
    *,
    pre: str = "default",
    add_prefix_space: bool = False,
) -> BackendTokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` from a vocabulary and merge list (GGUF layout)."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)  # a duplicated string keeps its first id
    # Llama-3 style vocabularies are meant to be matched whole before merging.
    ignore_merges = pre in ("llama-bpe", "llama3")
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=list(merges), ignore_merges=ignore_merges)
    )
    backend.pre_tokenizer = _pre_tokenizer(pre, add_prefix_space)
    backend.decoder = decoders.ByteLevel()
    # Control tokens are matched as whole units and dropped by skip_special_tokens;
    # user-defined ones are matched whole but kept in decoded text.
    added = [
        AddedToken(tokens[i], special=t == _TOKEN_CONTROL, normalized=False)
        for i, t in enumerate(token_types)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    if added:
        backend.add_tokens(added)
    return backend


def build_sentencepiece_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    token_types: Sequence[int],
    *,
    add_prefix_space: bool = True,
) -> BackendTokenizer:
    """A SentencePiece-BPE (Llama 1/2 style) `tokenizers.Tokenizer` from GGUF vocab + scores.

    SentencePiece stores no merge list: it merges whichever adjacent pair forms the
    highest-scoring piece. Ranking every (left, right) split of each piece by that score gives
    the equivalent merge list for a `tokenizers` BPE. Unknown bytes fall back to <0xNN> pieces.
    """
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab.setdefault(token, token_id)
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, token_id in vocab.items():
        if token_types[token_id] != _TOKEN_NORMAL:
            continue  # byte, control and unknown pieces are never the result of a merge
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[token_id], vocab[left], vocab[right], left, right))
    ranked.sort()
    unk = next((tokens[i] for i, t in enumerate(token_types) if t == _TOKEN_UNKNOWN), None)
    backend = BackendTokenizer(
        models.BPE(
            vocab=vocab,
            merges=[(left, right) for _, _, _, left, right in ranked],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # SentencePiece writes spaces as U+2581 and (by default) starts the text with one.
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", _SPM_SPACE)]
    if add_prefix_space:
        steps.insert(0, normalizers.Prepend(_SPM_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    undo = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        undo.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(undo)
    added = [
        AddedToken(tokens[i], special=t in (_TOKEN_CONTROL, _TOKEN_UNKNOWN), normalized=False)
        for i, t in enumerate(token_types)
        if t in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_UNKNOWN)
    ]
    if added:
        backend.add_tokens(added)
    return backend


def _pre_tokenizer(pre: str, add_prefix_space: bool) -> pre_tokenizers.PreTokenizer:
    if pre in ("llama-bpe", "llama3", "qwen2"):
        split = _QWEN2_SPLIT if pre == "qwen2" else _LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
            ]
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    if pre == "smollm":
        # SmolLM's tokenizer splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level
