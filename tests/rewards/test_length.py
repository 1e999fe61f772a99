from asyncrl.rewards import REWARDS


def test_length_counts_tokens_and_targets():
    ids = [[1, 2, 3], [1], []]
    assert REWARDS.build("length")([], [], ids) == [3.0, 1.0, 0.0]
    assert REWARDS.build({"name": "length", "target": 2, "scale": 0.5})([], [], ids) == [-0.5, -0.5, -1.0]
