"""examples/serve_swebench.py's argument checks: a bad setting is refused naming its flag, before any
server is started or attached (--dry-run and an unreachable --url: nothing is sent)."""
from __future__ import annotations

import pytest

from helpers import load_serve_swebench

sv = load_serve_swebench()


@pytest.mark.parametrize("extra, flag", [
    (["--sessions", "0"], "--sessions 0"),
    (["--requests", "3"], "--sessions 5"),  # more sessions than requests
    (["--rate", "0"], "--rate 0"),
    (["--mean-input", "0"], "--mean-input 0"),
    (["--cv", "9"], "--cv 9"),
    (["--max-input", "100"], "--max-input 100"),  # below one 512-token block
])
def test_generated_workload_errors_name_the_flag_not_trace(capsys, extra, flag):
    """No --trace given, yet the message read 'serve_swebench.py: --trace None: need 1 <= sessions ...'."""
    rc = sv.main(["--dry-run", "--requests", "50", "--sessions", "5", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and "--trace" not in err and flag in err, err


@pytest.mark.parametrize("extra, flag", [
    (["--limit", "0"], "--limit 0"),  # sent all 50 requests
    (["--limit", "-3"], "--limit -3"),  # sent all but the last 3
    (["--rate-factor", "0"], "--rate-factor 0"),  # blamed on --trace
    (["--max-input", "0"], "--max-input 0"),
])
def test_settings_below_their_range_are_refused(capsys, extra, flag):
    with pytest.raises(SystemExit) as e:
        sv.parse_args(["--dry-run", "--requests", "50", "--sessions", "5", *extra])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_limit_sends_the_first_n_requests():
    reqs, source = sv.build_workload(sv.parse_args(["--dry-run", "--requests", "50", "--sessions", "5",
                                                    "--limit", "7"]))
    assert len(reqs) == 7 and source["limit"] == 7


def test_a_vocab_without_token_ids_is_refused_before_sending(capsys):
    """--vocab 50 (token ids are drawn from [100, vocab)) passed the checks; the first request body then
    raised ValueError out of main(), after the server was started or attached."""
    with pytest.raises(SystemExit) as e:
        sv.main(["--url", "http://127.0.0.1:9", "--vocab", "50", "--requests", "4", "--sessions", "2",
                 "--no-progress", "--metrics-settle", "0"])
    assert e.value.code == 2 and "--vocab 50" in capsys.readouterr().err
