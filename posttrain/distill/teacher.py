"""What a teacher must share with its student: the tokenizer (a padded embedding allowed), checked at start.

check_teacher_vocab(teacher_rows, student_rows, "runs/teacher/hf", "runs/sft/hf")   # ConfigError naming both
mismatch = teacher_tokenizer_matches("runs/teacher/hf", tokenizer, tokenizer_dir)  # None, or what differs
teacher = load_teacher(cfg, mesh, student_vocab, "runs/sft/hf")    # the model on the mesh, its size checked
"""

from __future__ import annotations

from core.config_loader import ConfigError


def check_teacher_vocab(teacher_vocab: int, student_vocab: int, teacher: str, student: str) -> None:
    """Same tokenizer, possibly a padded embedding (extra teacher rows are ignored); else an error naming both
    models (`student`: where the student or its tokenizer comes from) and both sizes."""
    if teacher_vocab < student_vocab:
        raise ConfigError(
            f"the teacher {teacher!r} has a vocabulary of {teacher_vocab} rows, the student ({student}) "
            f"{student_vocab}: distillation here needs one tokenizer for both (a teacher may pad its embedding with "
            f"rows no token uses; cross-tokenizer distillation is not supported)"
        )


def teacher_tokenizer_matches(teacher: str, tokenizer, tokenizer_dir: str) -> str | None:
    """What is wrong when the tokenizer that came with the teacher (an HF directory's, a Temper run's:
    `core.tokenizer.checkpoint_tokenizer`) is not the run's (`tokenizer`, read from `tokenizer_dir`), naming both;
    None when they agree, or when the teacher has none to compare (its vocabulary size is still checked)."""
    from core.data import load_tokenizer
    from core.tokenizer import checkpoint_tokenizer
    from posttrain.distill.topk_store import tokenizer_digest

    found = checkpoint_tokenizer(teacher)
    if found is None:
        return None
    theirs = load_tokenizer(found)
    if tokenizer_digest(theirs) == tokenizer_digest(tokenizer):
        return None
    return (
        f"the teacher's tokenizer ({found}: {len(theirs)} tokens) is not the student's ({tokenizer_dir}: "
        f"{len(tokenizer)} tokens): distillation here needs one tokenizer for both (cross-tokenizer distillation "
        f"is not supported)"
    )


def check_teacher_tokenizer(teacher: str, tokenizer) -> None:
    """`teacher_tokenizer_matches` against the run's tokenizer, as a `ConfigError` at start (before a teacher is
    loaded or its actor started)."""
    from core.config_loader import ConfigError

    mismatch = teacher_tokenizer_matches(teacher, tokenizer, tokenizer.name_or_path or "the run's tokenizer")
    if mismatch:
        raise ConfigError(mismatch)


def load_teacher(cfg, mesh, student_vocab: int, student: str):
    """`distill.teacher` (in `distill.teacher_dtype`) read with its own shape onto `mesh`, its vocabulary checked
    against the student's (`check_teacher_vocab`)."""
    import jax

    from core.checkpoint_models import load_model_from

    path = str(cfg.distill.teacher)
    with jax.set_mesh(mesh):
        teacher = load_model_from(path, mesh, dtype=cfg.distill.teacher_dtype)
    check_teacher_vocab(teacher.cfg.vocab_size, student_vocab, path, student)
    return teacher
