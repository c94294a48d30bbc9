"""The distillation quickstart: the quickstart's GRPO model (the teacher) distilled into a student half its depth
and width, in each regime, next to GRPO on the same student.

    python -m recipes.quickstart --method distill [--run-dir runs/quickstart_distill] [--teacher-run runs/quickstart]
    make demo-distill

1. the teacher: the GRPO quickstart (`--teacher-run`, run first when it is not complete there: `make demo`);
2. the student (recipes/configs/quickstart/student.yml: 2 layers x 64 against the teacher's 4 x 128) pretrained
   and fine-tuned on the same data the teacher was (the same sloppy solutions);
3. offline: the teacher's top-64 at every completion token of the SFT rows, dumped once
   (`recipes.distill_logits`), then the student trained on it (`recipes.distill`, regime offline);
4. online: the teacher in the train step over the whole vocabulary, same rows;
5. on-policy: the student samples (vLLM on Ray), the teacher scores every sampled token;
6. GRPO on the same student, the quickstart's GRPO stage as it is.

Each stage starts from the fine-tuned student. Prints the held-out greedy accuracy (the quickstart's 200 held-out
problems, math_verify; greedy decoding with the JAX sampler for every model, so the figures compare) of the
teacher, the student before, and the student after each regime, with each stage's wall time and the student
tokens it trained on; the table goes to `quickstart_distill.json`, a bar chart of it to `quickstart_distill.png`,
and the on-policy stage plots the reverse KL it minimises (`on_policy/reverse_kl.png`). A finished stage is not
redone.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs" / "quickstart"
STUDENT_MODEL = [  # recipes/configs/quickstart/student.yml's model section, for the stages that start from scratch
    "model.hidden_size=64",
    "model.intermediate_size=256",
    "model.num_layers=2",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.head_dim=32",
]
SUMMARY = "quickstart_distill.json"


def greedy_accuracy(hf_dir: str | Path, rl_source: str, tokenizer: str, prompts: int = 200) -> float:
    """Held-out greedy accuracy of the model in `hf_dir` on the quickstart's GRPO eval split (math_verify)."""
    import jax

    from core.checkpoint_models import load_model_from
    from core.config_loader import load_config
    from core.mesh import make_mesh
    from posttrain.config import PostTrainConfig
    from posttrain.onpolicy.prompts import columns_of, prompt_rows, prompt_text, render_prompt
    from rewards.runner import RewardRunner
    from rollout.jax_sampler import JaxSampler
    from rollout.sampler import SamplingParams

    cfg = load_config(
        CONFIGS / "grpo.yml",
        [f"data.source={rl_source}", f"data.tokenizer_dir={tokenizer}", f"rl.eval_prompts={prompts}"],
        schema=PostTrainConfig,
    )
    _, held_out = prompt_rows(cfg)
    rows = held_out[: cfg.rl.eval_prompts]
    mesh = make_mesh(cfg.mesh)
    with jax.set_mesh(mesh):
        model = load_model_from(str(hf_dir), mesh)
    sampler = JaxSampler(model, tokenizer, mesh=mesh, max_model_len=cfg.rollout.max_model_len)
    params = SamplingParams(n=1, temperature=0.0, max_tokens=cfg.rollout.max_tokens)
    completions = sampler.generate([render_prompt(r, cfg.rl) for r in rows], params)
    assert cfg.rl.accuracy_fn is not None
    with RewardRunner(cfg.reward) as rewards:
        ok = rewards.score_fn(
            cfg.rl.accuracy_fn,
            [prompt_text(r, cfg.rl) for r in rows],
            [c.text for c in completions],
            columns_of(rows, 1),
        )
    return float((ok > 0).mean())


def trained_tokens(run_dir: Path, sampled: bool, per_step: int = 0) -> int:
    """Student tokens a stage trained on: target tokens a step (offline, online) or sampled completion tokens
    (on-policy, GRPO: `per_step` completions a step), summed over its steps."""
    from core.metrics import read_metrics

    rows = read_metrics(run_dir)
    if sampled:
        return int(sum(r["completion_length/mean"] * per_step for r in rows if "completion_length/mean" in r))
    logged = [r for r in rows if "tokens" in r and "eval/loss" not in r]
    steps = max(r["step"] for r in logged)
    return int(steps * sum(r["tokens"] for r in logged) / len(logged))


def run(out: Path, teacher_run: Path, seed: int) -> dict:
    from core.cli import run_cli
    from recipes.distill import main as distill_main
    from recipes.distill_logits import main as dump_main
    from recipes.pretrain import main as pretrain_main
    from recipes.quickstart import main as quickstart_main
    from recipes.sft import main as sft_main

    out.mkdir(parents=True, exist_ok=True)
    results_file = out / "stages.json"  # finished stages: a resumed quickstart does not redo them
    results: dict = json.loads(results_file.read_text()) if results_file.exists() else {}

    def check(rc: int) -> None:
        if rc:
            raise SystemExit(rc)

    def stage(name: str, title: str, fn) -> dict:
        if name in results:
            print(f"== {title}: done before ({results[name]})", flush=True)
            return results[name]
        print(f"== {title}", flush=True)
        start = time.perf_counter()
        result = fn()
        result["minutes"] = (time.perf_counter() - start) / 60
        results[name] = result
        results_file.write_text(json.dumps(results, indent=1))
        return result

    # 1. the teacher
    if not (teacher_run / "quickstart.json").exists():
        print(f"== the teacher: the GRPO quickstart in {teacher_run} (make demo)", flush=True)
        check(run_cli(quickstart_main, ["--run-dir", str(teacher_run)]))
    teacher = teacher_run / "grpo" / "hf"
    data, tokenizer = teacher_run / "data", str(teacher_run / "tokenizer")
    rl = str(data / "rl.jsonl")
    common = [f"data.tokenizer_dir={tokenizer}", f"run.seed={seed}"]

    def accuracy_of(hf: Path) -> dict:
        return {"accuracy": greedy_accuracy(hf, rl, tokenizer)}

    stage("teacher", "teacher: held-out greedy accuracy", lambda: accuracy_of(teacher))

    # 2. the student, as the teacher was made
    def student() -> dict:
        check(
            pretrain_main(
                [
                    str(CONFIGS / "pretrain.yml"),
                    f"run.run_dir={out / 'pretrain'}",
                    f"data.source={data / 'pretrain.jsonl'}",
                    *STUDENT_MODEL,
                    *common,
                ]
            )
        )
        check(
            sft_main(
                [
                    str(CONFIGS / "sft.yml"),
                    f"run.run_dir={out / 'sft'}",
                    f"data.source={data / 'sft.jsonl'}",
                    f"checkpoint.init_from={out / 'pretrain'}",
                    *common,
                ]
            )
        )
        return accuracy_of(out / "sft" / "hf")

    stage("student", "student: pretraining and fine-tuning (2 x 64)", student)
    start_from = f"checkpoint.init_from={out / 'sft' / 'hf'}"
    rows = [f"data.source={data / 'sft.jsonl'}", f"distill.teacher={teacher}", f"distill.logits_dir={out / 'topk'}"]

    def offline() -> dict:
        check(dump_main([str(CONFIGS / "distill.yml"), *rows, *common]))
        check(
            distill_main([str(CONFIGS / "distill.yml"), f"run.run_dir={out / 'offline'}", start_from, *rows, *common])
        )
        return {**accuracy_of(out / "offline" / "hf"), "tokens": trained_tokens(out / "offline", sampled=False)}

    def online() -> dict:
        stage_dir = f"run.run_dir={out / 'online'}"
        check(
            distill_main([str(CONFIGS / "distill.yml"), stage_dir, start_from, *rows, *common, "distill.regime=online"])
        )
        return {**accuracy_of(out / "online" / "hf"), "tokens": trained_tokens(out / "online", sampled=False)}

    def sampled(name: str, config: str, extra: list[str]) -> dict:
        from core.config_loader import load_config
        from posttrain.config import PostTrainConfig

        overrides = [f"run.run_dir={out / name}", f"data.source={rl}", start_from, *common, *extra]
        cfg = load_config(CONFIGS / config, overrides, schema=PostTrainConfig)
        from posttrain.distill.onpolicy import ON_POLICY_DISTILL
        from posttrain.fit import fit
        from posttrain.grpo import GRPO

        summary = fit(cfg, ON_POLICY_DISTILL if name == "on_policy" else GRPO)
        per_step = cfg.rl.batch.prompts_per_step * cfg.rl.batch.num_generations
        assert summary.hf_dir is not None
        return {**accuracy_of(summary.hf_dir), "tokens": trained_tokens(out / name, sampled=True, per_step=per_step)}

    stage("offline", "offline distillation: the teacher's top-64 dumped, then trained on", offline)
    stage("online", "online distillation: the teacher in the step, whole vocabulary", online)
    stage(
        "on_policy",
        "on-policy distillation: the student samples (vLLM on Ray), the teacher scores",
        lambda: sampled("on_policy", "distill_onpolicy.yml", [f"distill.teacher={teacher}"]),
    )
    stage("grpo", "GRPO on the same student (the quickstart's GRPO stage)", lambda: sampled("grpo", "grpo.yml", []))
    return results


def report(results: dict) -> str:
    lines = [
        f"held-out greedy accuracy (200 problems): teacher {results['teacher']['accuracy']:.1%}, "
        f"student {results['student']['accuracy']:.1%} before distillation",
        f"{'stage':<12} {'accuracy':>9} {'change':>8} {'minutes':>8} {'student tokens':>15}",
    ]
    before = results["student"]["accuracy"]
    for name in ("offline", "online", "on_policy", "grpo"):
        if name in results:
            r = results[name]
            lines.append(
                f"{name:<12} {r['accuracy']:>9.1%} {100 * (r['accuracy'] - before):>+7.1f}p {r['minutes']:>8.1f} "
                f"{r['tokens']:>15,}"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    """A bar chart of the held-out greedy accuracy: the teacher, the student before, and after each stage."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("teacher", "student", "offline", "online", "on_policy", "grpo") if n in results]
    values = [100 * results[n]["accuracy"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = ax.bar(names, values, color=["#555555", "#999999"] + ["#4477aa"] * (len(names) - 2))
    for bar, v in zip(bars, values):
        ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("held-out greedy accuracy (%)")
    ax.set_title("distilling the quickstart's GRPO model into a student half its size")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(out: Path, teacher_run: Path, seed: int) -> int:
    results = run(out, teacher_run, seed)
    text = report(results)
    print()
    print(text)
    (out / SUMMARY).write_text(json.dumps(results, indent=1))
    print(f"plot: {plot(results, out / 'quickstart_distill.png')}; on-policy curves: {out / 'on_policy'}/*.png")
    return 0
