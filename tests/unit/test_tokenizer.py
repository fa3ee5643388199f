"""Special ids come from the checkpoint's files, in the documented order of precedence."""

import json

import pytest

from actor.tasks.arith import build_tokenizer, special_ids, tokenizer_files
from model.tokenizer import Tokenizer


def _dir(tmp_path, config, generation=None, with_tok_config=True):
    for name, data in tokenizer_files().items():
        if name == "tokenizer.json" or with_tok_config:
            (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_ids_from_config_json(tmp_path):
    tok = Tokenizer.from_dir(_dir(tmp_path, special_ids()))
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, (2,), 0)
    assert tok.decode(tok.encode("47+38=")) == "47+38="


def test_generation_config_eos_list_wins_and_pad_falls_back_to_eos(tmp_path):
    tok = Tokenizer.from_dir(_dir(tmp_path, {"eos_token_id": 2}, {"eos_token_id": [5, 2]}, with_tok_config=False))
    assert tok.eos_ids == (5, 2) and tok.eos_id == 5
    assert tok.pad_id == 5 and tok.bos_id is None  # no pad anywhere: the first EOS pads


def test_ids_by_token_name_from_tokenizer_config(tmp_path):
    tok = Tokenizer.from_dir(_dir(tmp_path, {}))
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, (2,), 0)


def test_no_eos_anywhere_is_a_clear_error():
    with pytest.raises(ValueError, match="no EOS id"):
        Tokenizer.build(build_tokenizer(), {}, {}, {})


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))
