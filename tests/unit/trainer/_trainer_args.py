"""train_ppo.py flags for the tiny test assets (shared by the in-process trainer tests)."""


def train_args(tiny, output_dir: str, **flags) -> list[str]:
    """train_ppo.py flags for the tiny assets; `flags` override (lists become several values). No metrics.png
    (--plot false: half a second of each short run; tests/unit/outputs/test_run_logger.py checks the plot, and
    test_run_setup a run's)."""
    base = dict(actor_model_name_or_path=tiny.actor, reward_model_name_or_path=tiny.reward, data_path=tiny.prompts,
                max_prompt_seq_len=64, max_answer_seq_len=8, output_dir=output_dir, plot="false")
    base.update(flags)
    args = []
    for key, value in base.items():
        args.append(f"--{key}")
        args += [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return args
