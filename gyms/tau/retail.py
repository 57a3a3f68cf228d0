"""The 16 tau-bench retail tools (SPEC.md §3), quirks included: the gold hashes depend on them.

Tables: `users`, `orders`, `products`. Every documented error is returned before anything changes; a tool
copies a record (`Table.edit`) only once all its checks passed.
"""

import json
from collections import Counter
from typing import Any

from gyms.tau.store import EpisodeDB, Record, to_hashable
from gyms.tau.toolkit import SHARED_TOOLS, ToolFn, tool, tool_table

CANCEL_REASONS = ("no longer needed", "ordered by mistake")


@tool
def find_user_id_by_email(data: EpisodeDB, email: str) -> str:
    for user_id, user in data["users"].items():
        if user["email"].lower() == email.lower():
            return user_id
    return "Error: user not found"


@tool
def find_user_id_by_name_zip(data: EpisodeDB, first_name: str, last_name: str, zip: str) -> str:
    for user_id, user in data["users"].items():
        name = user["name"]
        if (
            name["first_name"].lower() == first_name.lower()
            and name["last_name"].lower() == last_name.lower()
            and user["address"]["zip"] == zip
        ):
            return user_id
    return "Error: user not found"


@tool
def get_order_details(data: EpisodeDB, order_id: str) -> str:
    orders = data["orders"]
    return json.dumps(orders[order_id]) if order_id in orders else "Error: order not found"


@tool
def get_product_details(data: EpisodeDB, product_id: str) -> str:
    products = data["products"]
    return json.dumps(products[product_id]) if product_id in products else "Error: product not found"


@tool
def list_all_product_types(data: EpisodeDB) -> str:
    names = {p["name"]: p["product_id"] for p in data["products"].values()}
    return json.dumps(dict(sorted(names.items())))


def _new_address(address1: Any, address2: Any, city: Any, state: Any, country: Any, zip: Any) -> Record:
    return {"address1": address1, "address2": address2, "city": city, "state": state, "country": country, "zip": zip}


@tool
def modify_user_address(
    data: EpisodeDB, user_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> str:
    users = data["users"]
    if user_id not in users:
        return "Error: user not found"
    user = users.edit(user_id)
    user["address"] = _new_address(address1, address2, city, state, country, zip)
    return json.dumps(user)


@tool
def modify_pending_order_address(
    data: EpisodeDB, order_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> str:
    orders = data["orders"]
    if order_id not in orders:
        return "Error: order not found"
    if orders[order_id]["status"] != "pending":
        return "Error: non-pending order cannot be modified"
    order = orders.edit(order_id)
    order["address"] = _new_address(address1, address2, city, state, country, zip)
    return json.dumps(order)


def _refund_gift_card(data: EpisodeDB, user_id: str, method_id: str, amount: float) -> None:
    """Gift cards get money back at once (other methods are refunded outside the system)."""
    method = data["users"].edit(user_id)["payment_methods"][method_id]
    method["balance"] = round(method["balance"] + amount, 2)


@tool
def cancel_pending_order(data: EpisodeDB, order_id: str, reason: str) -> str:
    orders = data["orders"]
    if order_id not in orders:
        return "Error: order not found"
    if orders[order_id]["status"] != "pending":
        return "Error: non-pending order cannot be cancelled"
    if reason not in CANCEL_REASONS:
        return "Error: invalid reason"
    order = orders.edit(order_id)
    refunds = []
    for entry in order["payment_history"]:  # [quirk] earlier refunds are refunded again
        method_id = entry["payment_method_id"]
        refunds.append({"transaction_type": "refund", "amount": entry["amount"], "payment_method_id": method_id})
        if "gift_card" in method_id:
            _refund_gift_card(data, order["user_id"], method_id, entry["amount"])
    order["status"] = "cancelled"
    order["cancel_reason"] = reason
    order["payment_history"].extend(refunds)
    return json.dumps(order)


@tool
def modify_pending_order_payment(data: EpisodeDB, order_id: str, payment_method_id: str) -> str:
    orders = data["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "pending":
        return "Error: non-pending order cannot be modified"
    methods = data["users"][order["user_id"]]["payment_methods"]
    if payment_method_id not in methods:
        return "Error: payment method not found"
    history = order["payment_history"]
    if len(history) != 1 or history[0]["transaction_type"] != "payment":
        return "Error: there should be exactly one payment for a pending order"
    old_method_id, amount = history[0]["payment_method_id"], history[0]["amount"]
    if payment_method_id == old_method_id:
        return "Error: the new payment method should be different from the current one"
    new_method = methods[payment_method_id]
    if new_method["source"] == "gift_card" and new_method["balance"] < amount:
        return "Error: insufficient gift card balance to pay for the order"

    order = orders.edit(order_id)
    order["payment_history"].extend(
        [
            {"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id},
            {"transaction_type": "refund", "amount": amount, "payment_method_id": old_method_id},
        ]
    )
    if new_method["source"] == "gift_card":
        method = data["users"].edit(order["user_id"])["payment_methods"][payment_method_id]
        method["balance"] = round(method["balance"] - amount, 2)
    if "gift_card" in old_method_id:
        _refund_gift_card(data, order["user_id"], old_method_id, amount)
    return json.dumps(order)


def _missing_items(order: Record, item_ids: list[str]) -> list[Any]:
    """[the first requested id asked for more often than the order holds it] (a multiset check), else [].

    tau-bench's check is `for i in item_ids: if item_ids.count(i) > held.count(i)`, so whatever `item_ids` is, the
    outcome is its outcome: a list is the multiset check; a string is checked character by character (str.count of
    one character counts it, and no item id is one character: its first character is missing; "" passes); a number,
    true/false or null raises `'int' object is not iterable` (Python's own text, from the iteration below); a
    non-empty object raises `'dict' object has no attribute 'count'` ({} passes: nothing to check).
    """
    # tau-bench counts with list.count per requested id: quadratic in a hostile list's length. One pass with the
    # same equality (to_hashable keeps == for the JSON values an argument can hold: [1] and [1.0] count alike).
    held = Counter(to_hashable(item["item_id"]) for item in order["items"])
    asked = Counter(to_hashable(item_id) for item_id in item_ids)
    if asked and isinstance(item_ids, dict):
        raise AttributeError("'dict' object has no attribute 'count'")
    for item_id in item_ids:
        if asked[to_hashable(item_id)] > held[to_hashable(item_id)]:
            return [item_id]
    return []


def _price_difference(data: EpisodeDB, order: Record, item_ids: list[str], new_item_ids: list[str]) -> Any:
    """Sum of new minus old prices, unrounded, in list order; or an error string for a bad new item."""
    diff = 0
    products = data["products"]
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        item = next(i for i in order["items"] if i["item_id"] == item_id)
        variants = products[item["product_id"]]["variants"]
        if not (new_item_id in variants and variants[new_item_id]["available"]):
            return f"Error: new item {new_item_id} not found or available"
        diff += variants[new_item_id]["price"] - item["price"]
    return diff


def _check_swap(
    data: EpisodeDB,
    order_id: str,
    item_ids: list[str],
    new_item_ids: list[str],
    payment_method_id: str,
    *,
    status: str,
    status_error: str,
    balance_error: str,
    rounded: bool,
) -> str | tuple[Record, Any, Record]:
    """The checks item modification and exchange share, in order: (order, price difference, method) or an error."""
    orders = data["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != status:
        return status_error
    missing = _missing_items(order, item_ids)
    if missing:  # a list: the missing id can be null
        return f"Error: {missing[0]} not found"
    if len(item_ids) != len(new_item_ids):
        return "Error: the number of items to be exchanged should match"
    diff = _price_difference(data, order, item_ids, new_item_ids)
    if isinstance(diff, str):
        return diff
    if rounded:  # [quirk] exchange rounds the difference, modification does not
        diff = round(diff, 2)
    methods = data["users"][order["user_id"]]["payment_methods"]
    if payment_method_id not in methods:
        return "Error: payment method not found"
    method = methods[payment_method_id]
    if method["source"] == "gift_card" and method["balance"] < diff:
        return balance_error
    return order, diff, method


@tool
def modify_pending_order_items(
    data: EpisodeDB, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> str:
    checked = _check_swap(
        data,
        order_id,
        item_ids,
        new_item_ids,
        payment_method_id,
        status="pending",
        status_error="Error: non-pending order cannot be modified",
        balance_error="Error: insufficient gift card balance to pay for the new item",
        rounded=False,
    )
    if isinstance(checked, str):
        return checked
    order, diff, method = checked
    order = data["orders"].edit(order_id)
    order["payment_history"].append(
        {
            "transaction_type": "payment" if diff > 0 else "refund",
            "amount": abs(diff),
            "payment_method_id": payment_method_id,
        }
    )
    if method["source"] == "gift_card":
        method = data["users"].edit(order["user_id"])["payment_methods"][payment_method_id]
        method["balance"] = round(method["balance"] - diff, 2)
    products = data["products"]
    for item_id, new_item_id in zip(item_ids, new_item_ids, strict=True):
        item = next(i for i in order["items"] if i["item_id"] == item_id)
        variant = products[item["product_id"]]["variants"][new_item_id]
        item["item_id"] = new_item_id
        item["price"] = variant["price"]
        item["options"] = dict(variant["options"])
    order["status"] = "pending (item modified)"
    return json.dumps(order)


@tool
def return_delivered_order_items(data: EpisodeDB, order_id: str, item_ids: list[str], payment_method_id: str) -> str:
    orders = data["orders"]
    if order_id not in orders:
        return "Error: order not found"
    order = orders[order_id]
    if order["status"] != "delivered":
        return "Error: non-delivered order cannot be returned"
    if payment_method_id not in data["users"][order["user_id"]]["payment_methods"]:
        return "Error: payment method not found"
    if "gift_card" not in payment_method_id and payment_method_id != order["payment_history"][0]["payment_method_id"]:
        return "Error: payment method should be either the original payment method or a gift card"
    if _missing_items(order, item_ids):
        return "Error: some item not found"

    order = orders.edit(order_id)
    order["status"] = "return requested"
    order["return_items"] = sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return json.dumps(order)


@tool
def exchange_delivered_order_items(
    data: EpisodeDB, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> str:
    checked = _check_swap(
        data,
        order_id,
        item_ids,
        new_item_ids,
        payment_method_id,
        status="delivered",
        status_error="Error: non-delivered order cannot be exchanged",
        balance_error="Error: insufficient gift card balance to pay for the price difference",
        rounded=True,
    )
    if isinstance(checked, str):
        return checked
    _, diff, _ = checked
    order = data["orders"].edit(order_id)
    order["status"] = "exchange requested"
    order["exchange_items"] = sorted(item_ids)
    order["exchange_new_items"] = sorted(new_item_ids)
    order["exchange_payment_method_id"] = payment_method_id
    order["exchange_price_difference"] = diff
    return json.dumps(order)


_OWN_TOOLS = (
    cancel_pending_order,
    exchange_delivered_order_items,
    find_user_id_by_email,
    find_user_id_by_name_zip,
    get_order_details,
    get_product_details,
    list_all_product_types,
    modify_pending_order_address,
    modify_pending_order_items,
    modify_pending_order_payment,
    modify_user_address,
    return_delivered_order_items,
)
TOOLS: dict[str, ToolFn] = tool_table("retail", (*SHARED_TOOLS.values(), *_OWN_TOOLS))
TABLES = ("orders", "products", "users")
