"""Teacher-student distillation in three regimes (docs/distillation.md): offline from a dumped top-k
(`topk_store`, `offline`), online with the teacher in the step (`offline`: the same method, another source of the
teacher's distribution), on-policy on the student's own samples (`onpolicy`). The loss is `objective`'s."""
