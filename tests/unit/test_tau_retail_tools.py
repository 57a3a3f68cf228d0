"""Every retail tool's error strings, effects and quirks (SPEC.md §3), on fresh copy-on-write databases.

Fixtures from the shipped DB: #W8955613 is pending, paid 585.97 by gift_card_6682391 (balance 35) of
olivia_lopez_9494; #W7303089 is delivered, paid by credit_card_4387170 of mei_gonzalez_4785 (also paypal_2568958);
#W4316152 is delivered and holds Tea Kettle 7292993796 (94.80) twice, paid by gift_card_7245904 (balance 17).
"""

import json

import pytest

from tests.support.tau import tool_caller, untouched_domain


@pytest.fixture(scope="module")
def retail(shared_data):
    yield from untouched_domain(shared_data, "retail")


@pytest.fixture
def db(retail):
    return retail.new_db()


@pytest.fixture
def call(retail, db):
    return tool_caller(retail, db)


def _balance(db, user_id, method_id):
    return db["users"][user_id]["payment_methods"][method_id]["balance"]


def test_lookups_and_their_errors(call):
    assert call("find_user_id_by_email", email="NOAH.Brown7922@example.COM") == "noah_brown_6181"
    assert call("find_user_id_by_email", email="nobody@example.com") == "Error: user not found"
    by_name = "find_user_id_by_name_zip"
    assert call(by_name, first_name="noah", last_name="BROWN", zip="80279") == "noah_brown_6181"
    assert call(by_name, first_name="Noah", last_name="Brown", zip="80280") == "Error: user not found"
    user = json.loads(call("get_user_details", user_id="noah_brown_6181"))
    assert user["email"] == "noah.brown7922@example.com" and user["orders"] == ["#W7678072"]
    assert call("get_user_details", user_id="noah_brown_0000") == "Error: user not found"
    assert json.loads(call("get_order_details", order_id="#W8955613"))["status"] == "pending"
    assert call("get_order_details", order_id="W8955613") == "Error: order not found"
    assert json.loads(call("get_product_details", product_id="6945232052"))["name"] == "Smart Watch"
    assert call("get_product_details", product_id="2554056026") == "Error: product not found"  # an item id


def test_list_all_product_types_is_sorted_by_name(call):
    types = json.loads(call("list_all_product_types"))
    assert len(types) == 50
    assert list(types) == sorted(types)
    assert types["Smart Watch"] == "6945232052" and types["Backpack"] == "2524789262"


def test_read_tools_return_python_json_dumps_of_the_record(call, db):
    assert call("get_order_details", order_id="#W8955613") == json.dumps(db["orders"]["#W8955613"])
    assert call("think", thought="plan") == ""
    assert call("transfer_to_human_agents", summary="help") == "Transfer successful"


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("2 * (3 + 4.5)", "15.0"),
        ("10 / 4", "2.5"),
        ("1 / 3", "0.33"),
        ("2 ** 10", "1024.0"),
        ("7 // 2", "3.0"),
        ("-(2.5)", "-2.5"),
        ("1/0", "Error: division by zero"),
        ("1.0//0", "Error: float floor division by zero"),
        ("abs(1)", "Error: invalid characters in expression"),
        ("1 % 2", "Error: invalid characters in expression"),
        ("", "Error: invalid syntax (<string>, line 0)"),
        ("(1", "Error: '(' was never closed (<string>, line 1)"),
        (
            "07+1",
            "Error: leading zeros in decimal integer literals are not permitted; use an 0o prefix for octal integers"
            " (<string>, line 1)",
        ),
        ("(2)(3)", "Error: 'int' object is not callable"),
        ("...", "Error: float() argument must be a string or a real number, not 'ellipsis'"),
        ("()", "Error: float() argument must be a string or a real number, not 'tuple'"),
        ("2 ** 2000", "Error: int too large to convert to float"),
        ("9**9**9**9", "Error: int too large to convert to float"),  # bounded instead of running for ever
        ("2.0 ** 5000", "Error: (34, 'Numerical result out of range')"),
        ("  2 * 3", "6.0"),  # eval drops leading spaces (compile alone says "unexpected indent")
        ("   ", "Error: invalid syntax (<string>, line 0)"),
        ("(1)(*2)", "Error: 1 argument after * must be an iterable, not int"),
        ("(1.5)(**2)", "Error: 1.5 argument after ** must be a mapping, not int"),
        ("()(*1)", "Error: () argument after * must be an iterable, not int"),
        ("(...)(*())", "Error: 'ellipsis' object is not callable"),
        ("(-8) ** 0.5", "Error: float() argument must be a string or a real number, not 'complex'"),
        ("(-1) ** (2 ** 60000)", "1.0"),
        ("2 ** 65535 // 2 ** 65530", "32.0"),
        ("(2 ** 65536) // (2 ** 65530)", "Error: int too large to convert to float"),  # tau-bench: 64.0
        ("(3**1048575)" + "*(3**1048575)" * 15, "Error: int too large to convert to float"),  # tau-bench: ~1 minute
        ("1" + " " * 10_000, "Error: expression longer than 10000 characters"),
    ],
)
def test_calculate(call, expression, expected):
    assert call("calculate", expression=expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "-" * 1000 + "1",  # 1,000 nested unary operators
        "1+" * 1000 + "1",  # a 1,000-deep chain of additions
        "(" * 199 + "2.5" + ")" * 199,  # the parser's parenthesis limit is 200
        "2**" * 3 + "2",
        "((2**30000)*(2**30000))//(2**59990)",
    ],
)
def test_calculate_evaluates_deep_expressions_as_eval_does(call, expression):
    """tau-bench evaluates these (compile would refuse the leading spaces; a recursive walk, the depth)."""
    expected = str(round(float(eval(expression, {"__builtins__": None}, {})), 2))
    assert call("calculate", expression=expression) == expected
    assert call("calculate", expression="  " + expression) == expected


@pytest.mark.parametrize(
    "expression",
    [
        "(" * 201 + "1" + ")" * 201,  # too many nested parentheses
        "1+" * 4000 + "1",  # deeper than the compiler goes
        "-" * 9000 + "1",  # the parser's own stack (MemoryError, with an empty message)
        "1" * 4301,  # the 4,300-digit limit
    ],
)
def test_calculate_failures_of_the_parser_read_as_eval_does(call, expression):
    try:
        eval(expression, {"__builtins__": None}, {})
    except (SyntaxError, RecursionError, MemoryError) as e:
        assert call("calculate", expression=expression) == f"Error: {e}"
    else:
        pytest.fail("eval accepted it")


def test_calculate_work_stays_within_its_budget():
    """The evaluation charges word operations; what would pass the budget is refused before it runs."""
    from gyms.tau import arithmetic

    cases = {
        "(3**41000)" + "*(3**41000)" * 20: OverflowError,  # each product would pass the size bound
        "((3**41000)//(3**40999))" * 1 + "+(3**41000)//(3**40999)" * 40: OverflowError,  # many large divisions
        "1+" * 2000 + "1": None,
        "(2**65000)-(2**65000)+1": None,
    }
    for expression, error in cases.items():
        budget = arithmetic.Budget()
        if error is None:
            assert arithmetic.evaluate(expression, budget) == eval(expression, {"__builtins__": None}, {})
        else:
            with pytest.raises(error, match=r"^int too large to convert to float$"):
                arithmetic.evaluate(expression, budget)
        assert 0 < budget.spent <= budget.limit == arithmetic.WORK_BUDGET


def test_calculate_with_non_string_expressions(call):
    assert call("calculate", expression=[]) == "Error: eval() arg 1 must be a string, bytes or code object"
    assert call("calculate", expression=5) == "Error: 'int' object is not iterable"


def test_calculate_matches_python_eval_on_random_arithmetic(call):
    import random

    rng = random.Random(0)
    for _ in range(300):
        terms = [str(rng.choice([rng.randint(0, 99), round(rng.uniform(0, 50), 2)])) for _ in range(rng.randint(1, 5))]
        expression = terms[0]
        for term in terms[1:]:
            expression = f"({expression}) {rng.choice(['+', '-', '*', '/', '//', '**'])} {term}"
        try:
            expected = str(round(float(eval(expression, {"__builtins__": None}, {})), 2))
        except Exception as e:
            expected = f"Error: {e}"
        assert call("calculate", expression=expression) == expected, expression


def test_argument_errors_read_like_tau_bench(call):
    assert call("cancel_pending_order", order_id="#W8955613") == (
        "Error: CancelPendingOrder.invoke() missing 1 required positional argument: 'reason'"
    )
    assert call("find_user_id_by_name_zip", first_name="a") == (
        "Error: FindUserIdByNameZip.invoke() missing 2 required positional arguments: 'last_name' and 'zip'"
    )
    assert call("think", thought="x", foo=1) == "Error: Think.invoke() got an unexpected keyword argument 'foo'"
    assert call("get_order_details", order_id=["#W1"]) == "Error: unhashable type: 'list'"
    assert call("delete_everything") == "Unknown action delete_everything"


def test_cancel_pending_order_refunds_gift_card_at_once(call, db, retail):
    assert call("cancel_pending_order", order_id="#W0000000", reason="no longer needed") == "Error: order not found"
    assert call("cancel_pending_order", order_id="#W2611340", reason="no longer needed") == (
        "Error: non-pending order cannot be cancelled"  # processed
    )
    assert call("cancel_pending_order", order_id="#W8955613", reason="changed my mind") == "Error: invalid reason"
    assert db.hash() == retail.base.hash()  # errors change nothing
    order = json.loads(call("cancel_pending_order", order_id="#W8955613", reason="no longer needed"))
    assert order["status"] == "cancelled" and order["cancel_reason"] == "no longer needed"
    assert order["payment_history"] == [
        {"transaction_type": "payment", "amount": 585.97, "payment_method_id": "gift_card_6682391"},
        {"transaction_type": "refund", "amount": 585.97, "payment_method_id": "gift_card_6682391"},
    ]
    assert _balance(db, "olivia_lopez_9494", "gift_card_6682391") == 620.97  # round(35 + 585.97, 2)
    assert retail.base.tables["orders"]["#W8955613"]["status"] == "pending"


def test_cancel_after_payment_change_refunds_every_entry_including_refunds(call, db):
    call("modify_pending_order_payment", order_id="#W8955613", payment_method_id="credit_card_6044108")
    assert _balance(db, "olivia_lopez_9494", "gift_card_6682391") == 620.97
    order = json.loads(call("cancel_pending_order", order_id="#W8955613", reason="ordered by mistake"))
    assert [(p["transaction_type"], p["payment_method_id"][:5]) for p in order["payment_history"]] == [
        ("payment", "gift_"),
        ("payment", "credi"),
        ("refund", "gift_"),
        ("refund", "gift_"),
        ("refund", "credi"),
        ("refund", "gift_"),
    ]
    assert _balance(db, "olivia_lopez_9494", "gift_card_6682391") == 1792.91  # 620.97 + 585.97 + 585.97


def test_modify_pending_order_address_and_user_address(call, db):
    address = dict(address1="1 Main St", address2="", city="Boston", state="MA", country="USA", zip="02110")
    assert call("modify_pending_order_address", order_id="#W2611340", **address) == (
        "Error: non-pending order cannot be modified"
    )
    assert call("modify_pending_order_address", order_id="#W1", **address) == "Error: order not found"
    out = call("modify_pending_order_address", order_id="#W8955613", **address)
    assert '"address": {"address1": "1 Main St", "address2": "", "city": "Boston", "state": "MA", "country"' in out
    assert call("modify_user_address", user_id="nobody_1", **address) == "Error: user not found"
    user = json.loads(call("modify_user_address", user_id="noah_brown_6181", **address))
    assert user["address"] == address
    assert db["orders"]["#W7678072"]["address"]["zip"] != "02110"  # the user's orders keep their address
    # lookups see the episode's change
    by_name = "find_user_id_by_name_zip"
    assert call(by_name, first_name="Noah", last_name="Brown", zip="02110") == "noah_brown_6181"
    assert call(by_name, first_name="Noah", last_name="Brown", zip="80279") == "Error: user not found"


def test_modify_pending_order_payment_checks_in_order(call, db):
    pay = "modify_pending_order_payment"
    assert call(pay, order_id="#W2611340", payment_method_id="x") == "Error: non-pending order cannot be modified"
    assert call(pay, order_id="#W8955613", payment_method_id="paypal_1") == "Error: payment method not found"
    assert call(pay, order_id="#W8955613", payment_method_id="gift_card_6682391") == (
        "Error: the new payment method should be different from the current one"
    )
    assert call(pay, order_id="#W6030855", payment_method_id="gift_card_5372803") == (
        "Error: insufficient gift card balance to pay for the order"  # 63 < 621.10
    )
    order = json.loads(call(pay, order_id="#W8955613", payment_method_id="credit_card_6044108"))
    assert order["status"] == "pending"
    assert order["payment_history"][1:] == [
        {"transaction_type": "payment", "amount": 585.97, "payment_method_id": "credit_card_6044108"},
        {"transaction_type": "refund", "amount": 585.97, "payment_method_id": "gift_card_6682391"},
    ]
    assert call(pay, order_id="#W8955613", payment_method_id="gift_card_6682391") == (
        "Error: there should be exactly one payment for a pending order"
    )


def test_modify_pending_order_items_difference_is_not_rounded(call, db):
    modify = "modify_pending_order_items"
    order = json.loads(
        call(
            modify,
            order_id="#W8955613",
            item_ids=["6309044598"],
            new_item_ids=["3928046918"],
            payment_method_id="gift_card_6682391",
        )
    )
    assert order["payment_history"][-1] == {
        "transaction_type": "refund",
        "amount": 20.590000000000003,  # abs(198.0 - 218.59), unrounded [quirk]
        "payment_method_id": "gift_card_6682391",
    }
    assert _balance(db, "olivia_lopez_9494", "gift_card_6682391") == 55.59
    backpack = order["items"][1]
    assert (backpack["item_id"], backpack["price"], backpack["name"]) == ("3928046918", 198.0, "Backpack")
    assert backpack["options"] == db["products"]["2524789262"]["variants"]["3928046918"]["options"]
    assert order["status"] == "pending (item modified)"
    assert call(modify, order_id="#W8955613", item_ids=[], new_item_ids=[], payment_method_id="x") == (
        "Error: non-pending order cannot be modified"
    )
    assert call("cancel_pending_order", order_id="#W8955613", reason="no longer needed") == (
        "Error: non-pending order cannot be cancelled"
    )


@pytest.mark.parametrize(
    ("item_ids", "new_item_ids", "method", "expected"),
    [
        (["1234"], ["3928046918"], "gift_card_6682391", "Error: 1234 not found"),
        (["6309044598", "6309044598"], ["3928046918"] * 2, "gift_card_6682391", "Error: 6309044598 not found"),
        (["6309044598"], [], "gift_card_6682391", "Error: the number of items to be exchanged should match"),
        (["6309044598"], ["8030558068"], "gift_card_6682391", "Error: new item 8030558068 not found or available"),
        (["6309044598"], ["2860956907"], "gift_card_6682391", "Error: new item 2860956907 not found or available"),
        (["6309044598"], ["3928046918"], "credit_card_1", "Error: payment method not found"),
    ],
)
def test_modify_pending_order_items_errors(call, db, retail, item_ids, new_item_ids, method, expected):
    out = call(
        "modify_pending_order_items",
        order_id="#W8955613",
        item_ids=item_ids,
        new_item_ids=new_item_ids,
        payment_method_id=method,
    )
    assert out == expected
    assert db.hash() == retail.base.hash()


def test_modify_pending_order_items_gift_card_must_cover_the_difference(call):
    out = call(
        "modify_pending_order_items",
        order_id="#W2918688",
        item_ids=["2106335193"],
        new_item_ids=["2235648106"],  # 903.95 -> 1054.43, gift card balance 36
        payment_method_id="gift_card_6023546",
    )
    assert out == "Error: insufficient gift card balance to pay for the new item"


def test_return_delivered_order_items(call, db):
    ret = "return_delivered_order_items"
    assert call(ret, order_id="#W8955613", item_ids=[], payment_method_id="gift_card_6682391") == (
        "Error: non-delivered order cannot be returned"
    )
    assert call(ret, order_id="#W7303089", item_ids=[], payment_method_id="gift_card_1") == (
        "Error: payment method not found"
    )
    assert call(ret, order_id="#W7303089", item_ids=[], payment_method_id="paypal_2568958") == (
        "Error: payment method should be either the original payment method or a gift card"
    )
    assert call(ret, order_id="#W4316152", item_ids=["7292993796"] * 3, payment_method_id="gift_card_7245904") == (
        "Error: some item not found"
    )
    order = json.loads(
        call(ret, order_id="#W7303089", item_ids=["7381052709", "2492465580"], payment_method_id="credit_card_4387170")
    )
    assert order["status"] == "return requested"
    assert order["return_items"] == ["2492465580", "7381052709"]
    assert order["return_payment_method_id"] == "credit_card_4387170"
    assert len(order["payment_history"]) == 1  # no money moves
    twice = json.loads(
        call(ret, order_id="#W4316152", item_ids=["7292993796"] * 2, payment_method_id="gift_card_7245904")
    )
    assert twice["return_items"] == ["7292993796", "7292993796"]
    assert _balance(db, "aarav_anderson_8794", "gift_card_7245904") == 17


def test_exchange_delivered_order_items(call, db):
    ex = "exchange_delivered_order_items"
    assert call(ex, order_id="#W8955613", item_ids=[], new_item_ids=[], payment_method_id="x") == (
        "Error: non-delivered order cannot be exchanged"
    )
    assert call(
        ex, order_id="#W4316152", item_ids=["7292993796"] * 3, new_item_ids=["9647374798"] * 3, payment_method_id="x"
    ) == ("Error: 7292993796 not found")
    assert call(
        ex,
        order_id="#W4316152",
        item_ids=["7292993796"] * 2,
        new_item_ids=["9647374798"] * 2,  # 2 x (109.58 - 94.80) = 29.56 > 17
        payment_method_id="gift_card_7245904",
    ) == ("Error: insufficient gift card balance to pay for the price difference")
    order = json.loads(
        call(
            ex,
            order_id="#W4316152",
            item_ids=["7292993796"],
            new_item_ids=["9647374798"],
            payment_method_id="gift_card_7245904",
        )
    )
    assert order["status"] == "exchange requested"
    assert order["exchange_items"] == ["7292993796"] and order["exchange_new_items"] == ["9647374798"]
    assert order["exchange_payment_method_id"] == "gift_card_7245904"
    assert order["exchange_price_difference"] == 14.78  # round(109.58 - 94.8, 2) [quirk: exchange rounds]
    assert _balance(db, "aarav_anderson_8794", "gift_card_7245904") == 17  # no balance change
    assert [i["item_id"] for i in order["items"]] == ["7292993796", "7292993796"]  # no item change
    down = json.loads(
        call(
            ex,
            order_id="#W7303089",
            item_ids=["2492465580"],
            new_item_ids=["3928046918"],
            payment_method_id="paypal_2568958",
        )
    )
    assert down["exchange_price_difference"] == -3.95


def test_the_item_multiset_check_is_linear_and_keeps_list_count_equality(call, db):
    """#W4316152 (delivered) holds 7292993796 twice: asking three times names it; 200,000 requested ids are one
    pass (tau-bench's list.count per id would be 4e10 comparisons); unhashable ids compare as list.count does."""
    exchange = "exchange_delivered_order_items"
    args = {"order_id": "#W4316152", "payment_method_id": "gift_card_7245904"}
    ids = ["7292993796"] * 3
    assert call(exchange, item_ids=ids, new_item_ids=ids, **args) == "Error: 7292993796 not found"
    many = ["7292993796", "7292993796"] + ["x"] * 200_000
    assert call(exchange, item_ids=many, new_item_ids=many, **args) == "Error: x not found"
    assert call(exchange, item_ids=[[1], [1.0]], new_item_ids=[1, 2], **args) == "Error: [1] not found"


# item_ids / new_item_ids of every JSON type: the outcome of tau-bench's `for i in item_ids: item_ids.count(i) ...`
# loop, whatever it is. Retail train task 2's only write returns #W4435622's 6777246137 to gift_card_1725971; task 6's
# exchanges #W1504875's 9421195098 for 9799386954 with paypal_6262583 (both without outputs to say).
RETURN = {"order_id": "#W4435622", "payment_method_id": "gift_card_1725971"}
EXCHANGE = {"order_id": "#W1504875", "payment_method_id": "paypal_6262583"}


@pytest.mark.parametrize(
    ("item_ids", "expected"),
    [
        ({"6777246137": 1}, "Error: 'dict' object has no attribute 'count'"),  # object
        ("6777246137", "Error: some item not found"),  # string: str.count per character; "6" is no item
        (6777246137, "Error: 'int' object is not iterable"),  # number
        (1.5, "Error: 'float' object is not iterable"),
        (True, "Error: 'bool' object is not iterable"),
        (None, "Error: 'NoneType' object is not iterable"),  # null
        ([None], "Error: some item not found"),  # a null id is missing like any other
    ],
)
def test_return_rejects_item_ids_as_tau_bench_does(retail, db, call, item_ids, expected):
    assert call("return_delivered_order_items", item_ids=item_ids, **RETURN) == expected
    assert db.hash() == retail.base.hash()
    assert retail.score(retail.task("train", 2), db, []).reward == 0.0


def test_return_item_ids_as_a_list_is_the_gold_return(retail, db, call):
    order = json.loads(call("return_delivered_order_items", item_ids=["6777246137"], **RETURN))
    assert (order["status"], order["return_items"]) == ("return requested", ["6777246137"])
    assert retail.score(retail.task("train", 2), db, []).reward == 1.0


@pytest.mark.parametrize("empty", [{}, ""])
def test_an_empty_object_or_string_returns_nothing_as_tau_bench_does(retail, db, call, empty):
    """tau-bench's loop has nothing to check, and `sorted` of either is []: the order becomes `return requested`."""
    order = json.loads(call("return_delivered_order_items", item_ids=empty, **RETURN))
    assert (order["status"], order["return_items"]) == ("return requested", [])
    assert retail.score(retail.task("train", 2), db, []).reward == 0.0


@pytest.mark.parametrize(
    ("item_ids", "new_item_ids", "expected"),
    [
        ({"9421195098": 1}, ["9799386954"], "Error: 'dict' object has no attribute 'count'"),  # object
        ("9421195098", ["9799386954"], "Error: 9 not found"),  # string: its first character is missing
        (9421195098, ["9799386954"], "Error: 'int' object is not iterable"),  # number
        (1.5, ["9799386954"], "Error: 'float' object is not iterable"),
        (False, ["9799386954"], "Error: 'bool' object is not iterable"),
        (None, ["9799386954"], "Error: 'NoneType' object is not iterable"),  # null
        ([None], ["9799386954"], "Error: None not found"),
        # new_item_ids: tau-bench takes its len, then its elements in order
        (["9421195098"], "9799386954", "Error: the number of items to be exchanged should match"),  # 10 characters
        (["9421195098"], "9", "Error: new item 9 not found or available"),
        (["9421195098"], 9799386954, "Error: object of type 'int' has no len()"),
        (["9421195098"], 1.5, "Error: object of type 'float' has no len()"),
        (["9421195098"], True, "Error: object of type 'bool' has no len()"),
        (["9421195098"], None, "Error: object of type 'NoneType' has no len()"),
        (["9421195098"], [None], "Error: new item None not found or available"),
        (["9421195098"], [["9799386954"]], "Error: unhashable type: 'list'"),
    ],
)
def test_exchange_rejects_item_ids_as_tau_bench_does(retail, db, call, item_ids, new_item_ids, expected):
    assert call("exchange_delivered_order_items", item_ids=item_ids, new_item_ids=new_item_ids, **EXCHANGE) == expected
    assert db.hash() == retail.base.hash()
    assert retail.score(retail.task("train", 6), db, []).reward == 0.0


@pytest.mark.parametrize(
    "new_item_ids",
    [["9799386954"], {"9799386954": 1}],  # an object works by accident in tau-bench: len 1, its keys, sorted keys
)
def test_exchange_with_list_item_ids_is_the_gold_exchange(retail, db, call, new_item_ids):
    out = call("exchange_delivered_order_items", item_ids=["9421195098"], new_item_ids=new_item_ids, **EXCHANGE)
    order = json.loads(out)
    assert (order["exchange_items"], order["exchange_new_items"]) == (["9421195098"], ["9799386954"])
    assert retail.score(retail.task("train", 6), db, []).reward == 1.0


def test_modify_pending_order_items_rejects_item_ids_as_an_object(call, db, retail):
    args = {"order_id": "#W8955613", "new_item_ids": ["3928046918"], "payment_method_id": "gift_card_6682391"}
    assert call("modify_pending_order_items", item_ids={"6309044598": 1}, **args) == (
        "Error: 'dict' object has no attribute 'count'"
    )
    assert call("modify_pending_order_items", item_ids=[None], **args) == "Error: None not found"
    assert db.hash() == retail.base.hash()


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("return_delivered_order_items", "return_delivered_order_items.ReturnDeliveredOrderItems"),
        ("think", "think.Think"),
        ("calculate", "calculate.Calculate"),
    ],
)
def test_a_call_passing_data_names_tau_benchs_module(call, db, retail, name, module):
    assert call(name, data={}) == (
        f"Error: tau_bench.envs.retail.tools.{module}.invoke() got multiple values for keyword argument 'data'"
    )
    assert db.hash() == retail.base.hash()
