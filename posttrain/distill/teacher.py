"""What a teacher must share with its student: the tokenizer (a padded embedding allowed), checked at start.

check_teacher_vocab(teacher_rows, student_rows, "runs/teacher/hf", "the run's")   # ConfigError naming both
mismatch = teacher_tokenizer_matches("runs/teacher/hf", tokenizer)                # None, or what differs
"""

from __future__ import annotations

from core.config_loader import ConfigError


def check_teacher_vocab(teacher_vocab: int, student_vocab: int, teacher: str, tokenizer_dir: str) -> None:
    """Same tokenizer, possibly a padded embedding (extra teacher rows are ignored); else an error naming both."""
    if teacher_vocab < student_vocab:
        raise ConfigError(
            f"the teacher {teacher!r} has a vocabulary of {teacher_vocab} rows, the student {student_vocab} "
            f"(tokenizer {tokenizer_dir!r}): distillation here needs one tokenizer for both (a teacher may pad its "
            f"embedding with rows no token uses; cross-tokenizer distillation is not supported)"
        )


def teacher_tokenizer_matches(teacher: str, tokenizer) -> str | None:
    """How the tokenizer that came with the teacher (an HF directory's, a Temper run's: `core.tokenizer`) differs
    from the run's, or None when it agrees or the teacher has none to compare."""
    from core.data import load_tokenizer
    from core.tokenizer import checkpoint_tokenizer
    from posttrain.distill.topk_store import tokenizer_digest

    found = checkpoint_tokenizer(teacher)
    if found is None:
        return None
    theirs = load_tokenizer(found)
    if tokenizer_digest(theirs) != tokenizer_digest(tokenizer):
        return f"{found}: {len(theirs)} tokens, the run's tokenizer {len(tokenizer)} tokens (or other tokens)"
    return None
