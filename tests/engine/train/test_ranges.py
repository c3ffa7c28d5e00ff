"""Every numeric setting of a run has a range (engine/train/ranges.py), and a value outside
it is refused before any work with a ConfigError naming the setting (exit 2 from the
command line), while every real use fits inside it.

These call the checks directly (config.check, the same that `ringpipe train` runs before
anything else): no run is started. Issue 34's reproductions are among them: counts of
10^20 that ran until SIGKILL (validation batches, sampled tokens, heads: a divisor search
of 10^20 steps), a weight decay that scaled the weights by -2e17 in one step, an ssp bound
of 10^20, and --pp 0 (a ZeroDivisionError).
"""
import dataclasses

import pytest

from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.gpt import GPTConfig, _divisor_near, divisors
from ringpipe.engine.train import ranges
from ringpipe.engine.train.cli import config_from_args, flag_name, parse_args
from ringpipe.engine.train.config import Config, check, parse_ps_mode

HUGE = "99999999999999999999"


def refusal(argv, world_size=1) -> str:
    """The message `ringpipe train ARGV` stops with before any work, as the command line prints it."""
    cfg = config_from_args(parse_args(argv))
    with pytest.raises(ConfigError) as refused:
        check(cfg, world_size)
    return refused.value.render(flag_name)


def test_every_numeric_setting_has_a_range():
    numeric = [f.name for f in dataclasses.fields(Config)
               if ("int" in str(f.type) or "float" in str(f.type)) and "bool" not in str(f.type)]
    assert len(numeric) > 35
    assert sorted(set(numeric) - set(ranges.RANGES)) == []
    assert sorted(set(ranges.RANGES) - set(numeric)) == []        # no range for a setting that is gone


@pytest.mark.parametrize("argv, says", [
    # counts that ran until SIGKILL
    (["--eval-batches", HUGE], f"--eval-batches must be <= 1,000,000, got {HUGE}"),
    (["--sample-tokens", HUGE], f"--sample-tokens must be <= 1,000,000, got {HUGE}"),
    (["--heads", HUGE], f"--heads must be <= 65,536, got {HUGE}"),
    (["--kv-heads", HUGE], "--kv-heads must be <= 65,536"),
    # silently wrong
    (["--weight-decay", "1e20"], "--weight-decay must be <= 100, got 1e+20"),
    (["--ps-mode", f"ssp:{HUGE}"], "S is the updates a worker may run ahead of the slowest, at most 1000"),
    (["--ps-mode", "ssp:" + "9" * 5000], "--ps-mode ssp:999999999999999999999999999999...: S is"),
    # tracebacks: a ZeroDivisionError before, for --pp 0
    (["--pp", "0"], "--pp must be >= 1, got 0"),
    (["--tp", "0"], "--tp must be >= 1, got 0"),
    (["--dp", "0"], "--dp must be >= 1, got 0"),
    (["--chunks", "0"], "--chunks must be >= 1, got 0"),
    (["--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["--pp", HUGE], "--pp must be <= 16,777,216"),
    # shapes and sizes far past anything real
    (["--layers", "1000000"], "--layers must be <= 16,384"),
    (["--d-model", HUGE], "--d-model must be <= 1,048,576"),
    (["--context", HUGE], "--context must be <= 16,777,216"),
    (["--seq-len", HUGE], "--seq-len must be <= 16,777,216"),
    (["--d-ff", HUGE], "--d-ff must be <= 4,194,304"),
    (["--batch-size", HUGE], "--batch-size must be <= 16,777,216"),
    (["--steps", HUGE], "--steps must be <= 1,000,000,000"),
    (["--warmup", HUGE], "--warmup must be <= 1,000,000,000"),
    (["--decay-steps", HUGE], "--decay-steps must be <= 1,000,000,000"),
    (["--eval-every", HUGE], "--eval-every must be <= 1,000,000,000"),
    (["--eval-every", "0"], "--eval-every must be >= 1, got 0"),
    (["--log-every", "0"], "--log-every must be >= 1, got 0"),
    (["--checkpoint-every", HUGE], "--checkpoint-every must be <= 1,000,000,000"),
    (["--keep", HUGE], "--keep must be <= 1,000,000,000"),
    (["--seed", HUGE], "--seed must be <= 9,223,372,036,854,775,807"),
    (["--max-data-mb", "1e30"], "--max-data-mb must be <= 1,073,741,824"),
    (["--bucket-mb", "1e30"], "--bucket-mb must be <= 1,048,576"),
    (["--ps-servers", HUGE], "--ps-servers must be <= 16,777,216"),
    # rates and ratios
    (["--lr", "1e9"], "--lr must be <= 1e+06"),
    (["--lr", "0"], "--lr must be > 0, got 0.0"),
    (["--lr", "0.5", "--weight-decay", "2"], "--lr 0.5 x --weight-decay 2 = 1: weight decay multiplies every "
                                             "weight by 1 - lr x weight_decay each step"),
    (["--optimizer", "sgd", "--lr", "20", "--weight-decay", "0.1"], "the product must stay below 1"),
    (["--grad-clip", "1e20"], "--grad-clip must be <= 1e+06, got 1e+20 (0 disables clipping)"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio is the fraction of --lr the schedule decays to: it must be between "
                              "0 and 1, got 2.0"),
    (["--rope-theta", "0.5", "--model", "llama"], "--rope-theta must be > 1, got 0.5"),
    (["--rope-theta", "1e300", "--model", "llama"], "--rope-theta must be <= 1e+12"),
    (["--straggler-ratio", "1e20"], "--straggler-ratio must be <= 1,000"),
    (["--straggler-intervals", HUGE], "--straggler-intervals must be <= 1,000,000,000"),
    (["--watchdog", "1e20"], "--watchdog must be <= 10,000,000"),
    (["--monitor-every", HUGE], "--monitor-every is the steps between per-rank measurements"),
    (["--metrics-port", "0"], "--metrics-port must be a TCP port, 1 to 65535, got 0"),
    # a word only some data takes
    (["--eval-batches", "all"], "--eval-batches all evaluates a classification set's validation split"),
])
def test_absurd_values_are_refused_naming_the_flag(argv, says):
    assert says in refusal(argv)


@pytest.mark.parametrize("field, value, says", [
    ("layers", 2.5, "layers must be a whole number, got 2.5"),
    ("steps", True, "steps must be a whole number, got True"),
    ("lr", "0.1", "lr must be a number, got '0.1'"),
    ("eval_batches", "most", "eval_batches must be a whole number or all, got 'most'"),
    ("monitor_every", "sometimes", "monitor_every is the steps between per-rank measurements"),
])
def test_a_library_config_of_the_wrong_kind_is_refused(field, value, says):
    with pytest.raises(ConfigError, match=says):
        check(Config(**{field: value}), 1)


@pytest.mark.parametrize("argv, world_size", [
    (["--preset", "gpt2-1558m"], 1),                                             # GPT-2 1.5B
    (["--layers", "48", "--d-model", "1600", "--heads", "25", "--context", "1024"], 1),
    (["--model", "llama", "--layers", "126", "--d-model", "16384", "--heads", "128", "--kv-heads", "8",
      "--d-ff", "53248", "--context", "131072", "--rope-theta", "500000"], 1),   # Llama 3.1 405B's shape
    (["--context", "131072", "--seq-len", "131072"], 1),                         # 128k context
    (["--context", "10000000"], 1),                                              # 10M (Llama 4 Scout)
    (["--steps", "1000000", "--warmup", "2000", "--checkpoint-every", "5000", "--eval-every", "1000",
      "--eval-batches", "200", "--keep", "100"], 1),                             # a million steps
    (["--dp", "4096", "--batch-size", "8192"], 4096),                            # thousands of ranks
    (["--dp", "512", "--pp", "16", "--tp", "8", "--batch-size", "4096", "--microbatches", "8"], 65536),
    (["--optimizer", "sgd", "--lr", "29", "--weight-decay", "5e-5"], 1),         # LARS-scale SGD
    (["--lr", "6e-4", "--weight-decay", "0.1", "--grad-clip", "1", "--min-lr-ratio", "0"], 1),
    (["--seed", "1700000000000000000", "--sample-tokens", "100000", "--watchdog", "3600"], 1),
    (["--model", "mlp", "--eval-batches", "all", "--batch-size", "60000"], 1),
])
def test_real_runs_fit_inside_every_range(argv, world_size):
    check(config_from_args(parse_args(argv)), world_size)        # no ConfigError


def test_ssp_bounds_up_to_the_limit_are_taken():
    assert parse_ps_mode("ssp:0") == ("ssp", 0)
    assert parse_ps_mode("ssp:1000") == ("ssp", 1000)
    assert parse_ps_mode("ssp:0001000") == ("ssp", 1000)
    with pytest.raises(ConfigError, match="at most 1000"):
        parse_ps_mode("ssp:1001")


def test_a_divisor_suggestion_takes_no_steps_of_the_size_of_the_heads():
    """The message for heads that do not divide the width names the nearest divisor; it
    was found by stepping outwards from --heads (10^20 steps for --heads 10^20)."""
    assert divisors(768) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 768]
    assert divisors(1) == [1] and divisors(97) == [1, 97]
    assert [_divisor_near(768, k) for k in (1, 5, 7, 10, 13, 700, 10**6)] == [1, 4, 6, 8, 12, 768, 768]
    assert _divisor_near(2**41, 5) == 4                  # past 2^40: divisors found among the first 2^20 pairs
    with pytest.raises(ConfigError, match=r"divisible by n_head 7 \(try n_head 6\)"):
        GPTConfig(d_model=768, n_head=7).validate()
