"""``llmgw ctl leader``'s lines for each answer of GET /admin/v1/leader."""

from llmgw.ctl.leader import describe


def test_a_leader_a_follower_and_nobody():
    leading = {"server": "cp1", "leader": True, "term": 3, "live_servers": ["cp1", "cp2"],
               "quota_share": {"servers": 2, "rank": 0}}  # fmt: skip
    assert describe(leading) == (
        "this server (cp1) leads, term 3\nlive servers: cp1, cp2\n"
        "quotas: this server admits share 1 of 2 of every limit"
    )
    following = {
        "server": "cp2",
        "leader": False,
        "term": 3,
        "holder": "cp1",
        "holder_address": "10.0.0.1:7070",
    }
    assert describe(following) == "this server (cp2) follows cp1 (agent link 10.0.0.1:7070), term 3"
    assert describe({"leader": False, "term": 4, "holder": ""}).startswith("nobody leads right now (term 4)")
