"""Hugging Face formats: checkpoint directories (`directory`), their config.json (`config`), the tensor layout of
each family (`layout`), what a process's devices hold of each tensor (`pieces`), Hub ids (`hub`) and PEFT
adapters (`peft`)."""
