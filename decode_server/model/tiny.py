"""The embedded models `tiny-dsa` (default) and `tiny-glm5`: generated deterministically on first use as real
checkpoints.

`configs/tiny-dsa.json` keeps DeepSeek-V3.2's row format (kv_lora_rank 512 + rope 64, 128-dim indexer heads,
16 heads) with everything else small, and `index_topk` 64 so sparsity shows at short lengths. The generator
writes what a downloaded checkpoint holds — `config.json`, `model.safetensors` (projection weights as FP8 e4m3
with 128×128 block `weight_scale_inv`, embeddings/router in bf16, norms in fp32), a byte-level BPE
`tokenizer.json` trained on an embedded text, and a `tokenizer_config.json` with a chat template — and the
model is then loaded through the normal loader and tokenizer. `configs/tiny-glm5.json` is the GLM-5
(`glm_moe_dsa`) counterpart: GLM-5's head sizes (nope 192, v 256, same 512 + 64 row), n_group 1, rms_norm_eps
1e-5, interleaved indexer RoPE, full and shared indexer layers, and a GLM-style tokenizer and chat template.

Generation is atomic: files go to a temporary directory inside the cache, which is renamed into place, so a
concurrent process sees either nothing or a complete checkpoint. The directory name carries a digest of the
config, seed and generator version, so any change regenerates it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from decode_server.model.checkpoint_writer import stored_form as _stored_form
from decode_server.model.config import ModelConfig
from decode_server.model.construct import build_empty_model, randomize_weights

logger = logging.getLogger(__name__)

TINY_NAME = "tiny-dsa"
GLM_TINY_NAME = "tiny-glm5"
TINY_SEED = 20251122
GENERATOR_VERSION = 2
# configs/ of the repository, reached through the decode_server/model/configs symlink in a source checkout and
# shipped as package data in the wheel (so an installed server, e.g. in the image, has tiny-dsa too).
CONFIG_DIR = Path(__file__).resolve().parent / "configs"

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]

# DeepSeek-style template: BOS, optional system text, then alternating User/Assistant turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)

# GLM-style tokens and template (GLM-4.5 / GLM-5 layout: "[gMASK]<sop>", then "<|role|>\n" + content per turn).
GLM_EOS = "<|endoftext|>"
GLM_SPECIAL_TOKENS = [GLM_EOS, "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% else %}{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """An embedded model: its config in configs/, seed, tokenizer special tokens and chat template."""

    name: str
    seed: int
    special_tokens: tuple[str, ...]
    bos: str | None  # added by the tokenizer's post-processor (None: the chat template carries the prefix)
    eos: str
    chat_template: str


TINY_SPECS = {
    TINY_NAME: TinySpec(TINY_NAME, TINY_SEED, tuple(SPECIAL_TOKENS), BOS, EOS, CHAT_TEMPLATE),
    GLM_TINY_NAME: TinySpec(GLM_TINY_NAME, TINY_SEED + 1, tuple(GLM_SPECIAL_TOKENS), None, GLM_EOS,
                            GLM_CHAT_TEMPLATE),
}

# Training text for the tokenizer (written for this project). Varied words give the BPE enough merges.
TRAINING_TEXT = """\
A decode server keeps every request's key and value cache in host memory and copies only the rows the
lightning indexer selects into a small buffer on the accelerator. Sparse attention reads a fixed number of
tokens per step, so the cost of a step does not grow with the length of the conversation.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft
zebras jump! Sphinx of black quartz, judge my vow. The five boxing wizards jump quickly.
Once upon a time, in a small village between the mountains and the sea, there lived a clockmaker who built
instruments that measured not hours but the patience of the people who owned them. Every morning she opened
her shop, swept the floor, wound the great pendulum, and waited for the first visitor of the day.
Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 42 + - * / = < > ( ) [ ] { } # @ % & ;
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
Questions and answers. What is the capital of France? The capital of France is Paris. What is the largest
planet in the solar system? Jupiter is the largest planet. Why is the sky blue? Sunlight scatters off the
molecules of the air, and blue light scatters more than red light.
Hello! How are you today? I am fine, thank you. Could you please explain how attention works in a
transformer? Each token forms a query, compares it with the keys of earlier tokens, and mixes their values
according to the resulting weights. Multi-head latent attention compresses keys and values into a shared
latent vector of five hundred and twelve numbers plus sixty-four rotary dimensions.
The mixture of experts routes each token to a few specialists chosen by a gate; shared experts see every
token. Groups of experts are ranked first, then the best experts inside the surviving groups are selected.
Weather report: cloudy in the morning, sunny in the afternoon, light rain expected tonight with winds from
the north west. Temperatures between twelve and nineteen degrees. Tomorrow will be warmer and dry.
Recipe: mix flour, water, salt and yeast; knead the dough for ten minutes; let it rise for two hours; bake
at two hundred and twenty degrees until golden. Serve warm with butter, honey, cheese or fresh tomatoes.
In mathematics, a prime number is a natural number greater than one that is not a product of two smaller
natural numbers. Euclid proved that there are infinitely many primes. Every integer factors uniquely.
Rivers, forests, deserts, oceans, islands, valleys, glaciers, volcanoes, meadows, canyons and lakes.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June July August
September October November December spring summer autumn winter north south east west red green blue yellow
"""


def cache_dir() -> Path:
    """`$HISPARSE_CACHE_DIR`, default `~/.cache/hisparse-decode-server/`."""
    root = os.environ.get("HISPARSE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "hisparse-decode-server"


def tiny_config_dict(name: str = TINY_NAME) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {name} is defined by configs/ (shipped in the wheel)")
    with path.open() as fh:
        return json.load(fh)


def tiny_checkpoint_dir(name: str = TINY_NAME) -> Path:
    spec = TINY_SPECS[name]
    raw = tiny_config_dict(name)
    parts: list = [raw, spec.seed, GENERATOR_VERSION, TRAINING_TEXT, spec.chat_template]
    if name != TINY_NAME:  # tiny-dsa's digest predates the other specs: keep its cache directory
        parts += [list(spec.special_tokens), spec.bos, spec.eos]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    return cache_dir() / f"{name}-{digest}"


def ensure_tiny_checkpoint(name: str = TINY_NAME) -> Path:
    """Path of an embedded model's checkpoint, generating it first if no complete copy exists."""
    target = tiny_checkpoint_dir(name)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_tiny_checkpoint(staging, name)
        staging.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by several users
        for file in staging.iterdir():
            file.chmod(0o644)
        try:
            os.rename(staging, target)
            logger.info("generated %s at %s", name, target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process finished first; its copy is identical (deterministic generation).
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def build_tokenizer(vocab_size: int, spec: TinySpec = TINY_SPECS[TINY_NAME]) -> HFTokenizer:
    """Byte-level BPE trained on TRAINING_TEXT (deterministic), padded with reserved special tokens."""
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    missing = vocab_size - tokenizer.get_vocab_size(with_added_tokens=True)
    if missing > 0:  # every id the model can emit must decode
        tokenizer.add_special_tokens([f"<｜reserved_{i}｜>" for i in range(missing)])
    if spec.bos is not None:
        bos = spec.bos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
        )
    return tokenizer


def tokenizer_config(spec: TinySpec = TINY_SPECS[TINY_NAME]) -> dict:
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos,
        "eos_token": spec.eos,
        "pad_token": spec.eos,
        "add_bos_token": spec.bos is not None,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": tiny_config_dict(spec.name)["max_position_embeddings"],
        "chat_template": spec.chat_template,
    }
    return {k: v for k, v in config.items() if v is not None}


def write_tiny_checkpoint(out_dir: Path, name: str = TINY_NAME) -> None:
    spec = TINY_SPECS[name]
    raw = tiny_config_dict(name)
    config = ModelConfig.from_dict(raw)
    tokenizer = build_tokenizer(config.vocab_size, spec)
    bos_id = tokenizer.token_to_id(spec.bos) if spec.bos is not None else None
    if (bos_id is not None and bos_id != config.bos_token_id) or (
            tokenizer.token_to_id(spec.eos) != config.eos_token_ids[0]):
        raise RuntimeError(f"{name} tokenizer special-token ids disagree with configs/{name}.json")
    model = build_empty_model(config, "cpu", torch.float32)
    randomize_weights(model, spec.seed)
    block = config.weight_block_size
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        tensors.update(_stored_form(key, tensor.detach().contiguous(), block))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**raw, "torch_dtype": "bfloat16"}, indent=2))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2, ensure_ascii=False))
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}, indent=2)
    )
