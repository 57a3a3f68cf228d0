"""tau2's retail domain (SPEC.md §3.2, §5): the dump shape of its records and its 16 tools, quirks included."""

import json

from gyms.tau.store import Record
from gyms.tau2.store import Tau2DB
from gyms.tau2.toolkit import ToolFn, calculate, toolkit, transfer_to_human_agents

TABLES = ("products", "users", "orders")
ADDRESS = ("address1", "address2", "city", "country", "state", "zip")
ORDER_OPTIONAL = (
    "cancel_reason", "exchange_items", "exchange_new_items", "exchange_payment_method_id",
    "exchange_price_difference", "return_items", "return_payment_method_id",
)  # fmt: skip
CANCEL_REASONS = ("no longer needed", "ordered by mistake")


def _pick(raw: Record, fields: tuple[str, ...]) -> Record:
    return {f: raw.get(f) for f in fields}


def _method(raw: Record) -> Record:
    if raw["source"] == "credit_card":
        return _pick(raw, ("source", "id", "brand", "last_four"))
    if raw["source"] == "gift_card":
        return {"source": "gift_card", "id": raw["id"], "balance": float(raw["balance"])}
    return _pick(raw, ("source", "id"))


def normalise(table: str, raw: Record) -> Record:
    """A record of `table` as upstream's model dumps it: every field, in field order, floats where declared."""
    if table == "products":
        variants = {
            k: {**_pick(v, ("item_id", "options", "available")), "price": float(v["price"])}
            for k, v in raw["variants"].items()
        }
        return {"name": raw["name"], "product_id": raw["product_id"], "variants": variants}
    if table == "users":
        return {
            "user_id": raw["user_id"],
            "name": _pick(raw["name"], ("first_name", "last_name")),
            "address": _pick(raw["address"], ADDRESS),
            "email": raw["email"],
            "payment_methods": {k: _method(m) for k, m in raw["payment_methods"].items()},
            "orders": list(raw["orders"]),
        }
    order = {
        "order_id": raw["order_id"],
        "user_id": raw["user_id"],
        "address": _pick(raw["address"], ADDRESS),
        "items": [
            {**_pick(i, ("name", "product_id", "item_id")), "price": float(i["price"]), "options": i["options"]}
            for i in raw["items"]
        ],
        "status": raw["status"],
        "fulfillments": [_pick(f, ("tracking_id", "item_ids")) for f in raw["fulfillments"]],
        "payment_history": [
            {
                "transaction_type": p["transaction_type"],
                "amount": float(p["amount"]),
                "payment_method_id": p["payment_method_id"],
            }
            for p in raw["payment_history"]
        ],
        **_pick(raw, ORDER_OPTIONAL),
    }
    if order["exchange_price_difference"] is not None:
        order["exchange_price_difference"] = float(order["exchange_price_difference"])
    return order


def _order(db: Tau2DB, order_id: str) -> Record:
    if order_id not in db["orders"]:
        raise ValueError("Order not found")
    return db["orders"][order_id]


def _user(db: Tau2DB, user_id: str) -> Record:
    if user_id not in db["users"]:
        raise ValueError("User not found")
    return db["users"][user_id]


def _product(db: Tau2DB, product_id: str) -> Record:
    if product_id not in db["products"]:
        raise ValueError("Product not found")
    return db["products"][product_id]


def _variant(db: Tau2DB, product_id: str, item_id: str) -> Record:
    product = _product(db, product_id)
    if item_id not in product["variants"]:
        raise ValueError("Variant not found")
    return product["variants"][item_id]


def _method_of(db: Tau2DB, user_id: str, method_id: str) -> Record:
    user = _user(db, user_id)
    if method_id not in user["payment_methods"]:
        raise ValueError("Payment method not found")
    return user["payment_methods"][method_id]


def _add_balance(db: Tau2DB, user_id: str, method_id: str, amount: float) -> None:
    """A gift card's balance += amount, rounded to 2 decimals."""
    method = db["users"].edit(user_id)["payment_methods"][method_id]
    method["balance"] = round(method["balance"] + amount, 2)


def _check_counts(order: Record, item_ids: list[str], message: str) -> None:
    present = [i["item_id"] for i in order["items"]]
    for item_id in item_ids:
        if item_ids.count(item_id) > present.count(item_id):
            raise ValueError(message.format(item_id=item_id))


def find_user_id_by_email(db: Tau2DB, email: str) -> str:
    for user_id, user in db["users"].items():
        if user["email"].lower() == email.lower():
            return user_id
    raise ValueError("User not found")


def find_user_id_by_name_zip(db: Tau2DB, first_name: str, last_name: str, zip: str) -> str:
    for user_id, user in db["users"].items():
        name = user["name"]
        if (
            name["first_name"].lower() == first_name.lower()
            and name["last_name"].lower() == last_name.lower()
            and user["address"]["zip"] == zip
        ):
            return user_id
    raise ValueError("User not found")


def get_user_details(db: Tau2DB, user_id: str) -> Record:
    return _user(db, user_id)


def get_order_details(db: Tau2DB, order_id: str) -> Record:
    return _order(db, order_id)


def get_product_details(db: Tau2DB, product_id: str) -> Record:
    return _product(db, product_id)


def get_item_details(db: Tau2DB, item_id: str) -> Record:
    for product in db["products"].values():
        if item_id in product["variants"]:
            return product["variants"][item_id]
    raise ValueError("Item not found")


def list_all_product_types(db: Tau2DB) -> str:
    return json.dumps({p["name"]: p["product_id"] for p in db["products"].values()}, sort_keys=True)


def cancel_pending_order(db: Tau2DB, order_id: str, reason: str) -> Record:
    order = _order(db, order_id)
    if order["status"] != "pending":
        raise ValueError("Non-pending order cannot be cancelled")
    if reason not in CANCEL_REASONS:
        raise ValueError("Invalid reason")
    refunds = []
    for payment in order["payment_history"]:
        refunds.append(
            {
                "transaction_type": "refund",
                "amount": payment["amount"],
                "payment_method_id": payment["payment_method_id"],
            }
        )
        method = _method_of(db, order["user_id"], payment["payment_method_id"])
        if method["source"] == "gift_card":
            _add_balance(db, order["user_id"], payment["payment_method_id"], payment["amount"])
    order = db["orders"].edit(order_id)
    order["status"], order["cancel_reason"] = "cancelled", reason
    order["payment_history"].extend(refunds)
    return order


def _price_difference(
    db: Tau2DB, order: Record, item_ids: list[str], new_item_ids: list[str], same: bool
) -> tuple[float, Record | None]:
    """Σ(new − old) over the pairs, and the last variant looked up (upstream reuses it, [quirk])."""
    diff: float = 0
    variant = None
    for item_id, new_id in zip(item_ids, new_item_ids, strict=False):
        if not same and item_id == new_id:
            raise ValueError("The new item id should be different from the old item id")
        item = next((i for i in order["items"] if i["item_id"] == item_id), None)
        if item is None:
            raise ValueError(f"Item {item_id} not found")
        variant = _variant(db, item["product_id"], new_id)
        if not variant["available"]:
            raise ValueError(f"New item {new_id} not found or available")
        diff += variant["price"] - item["price"]
    return diff, variant


def exchange_delivered_order_items(
    db: Tau2DB, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> Record:
    order = _order(db, order_id)
    if order["status"] != "delivered":
        raise ValueError("Non-delivered order cannot be exchanged")
    _check_counts(order, item_ids, "Number of {item_id} not found.")
    if len(item_ids) != len(new_item_ids):
        raise ValueError("The number of items to be exchanged should match.")
    diff = round(_price_difference(db, order, item_ids, new_item_ids, True)[0], 2)
    method = _method_of(db, order["user_id"], payment_method_id)
    if method["source"] == "gift_card" and method["balance"] < diff:
        raise ValueError("Insufficient gift card balance to pay for the price difference")
    order = db["orders"].edit(order_id)
    order["status"] = "exchange requested"
    order["exchange_items"], order["exchange_new_items"] = sorted(item_ids), sorted(new_item_ids)
    order["exchange_payment_method_id"], order["exchange_price_difference"] = payment_method_id, diff
    return order


def _new_address(address1: str, address2: str, city: str, state: str, country: str, zip: str) -> Record:
    return {"address1": address1, "address2": address2, "city": city, "country": country, "state": state, "zip": zip}


def modify_pending_order_address(
    db: Tau2DB, order_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> Record:
    if "pending" not in _order(db, order_id)["status"]:
        raise ValueError("Non-pending order cannot be modified")
    order = db["orders"].edit(order_id)
    order["address"] = _new_address(address1, address2, city, state, country, zip)
    return order


def modify_user_address(
    db: Tau2DB, user_id: str, address1: str, address2: str, city: str, state: str, country: str, zip: str
) -> Record:
    _user(db, user_id)
    user = db["users"].edit(user_id)
    user["address"] = _new_address(address1, address2, city, state, country, zip)
    return user


def modify_pending_order_items(
    db: Tau2DB, order_id: str, item_ids: list[str], new_item_ids: list[str], payment_method_id: str
) -> Record:
    """[quirk] the amount is unrounded; every modified item takes the last looked-up variant's price/options."""
    order = _order(db, order_id)
    if order["status"] != "pending":
        raise ValueError("Non-pending order cannot be modified")
    _check_counts(order, item_ids, "{item_id} not found")
    if len(item_ids) != len(new_item_ids):
        raise ValueError("The number of items to be exchanged should match")
    diff, variant = _price_difference(db, order, item_ids, new_item_ids, False)
    method = _method_of(db, order["user_id"], payment_method_id)
    if method["source"] == "gift_card" and method["balance"] < diff:
        raise ValueError("Insufficient gift card balance to pay for the new item")
    order = db["orders"].edit(order_id)
    kind = "payment" if diff > 0 else "refund"
    order["payment_history"].append(
        {"transaction_type": kind, "amount": float(abs(diff)), "payment_method_id": payment_method_id}
    )
    if method["source"] == "gift_card":
        _add_balance(db, order["user_id"], payment_method_id, -diff)
    for item_id, new_id in zip(item_ids, new_item_ids, strict=False):
        item = next(i for i in order["items"] if i["item_id"] == item_id)
        assert variant is not None
        item["item_id"], item["price"], item["options"] = new_id, variant["price"], dict(variant["options"])
    order["status"] = "pending (item modified)"
    return order


def modify_pending_order_payment(db: Tau2DB, order_id: str, payment_method_id: str) -> Record:
    order = _order(db, order_id)
    if "pending" not in order["status"]:
        raise ValueError("Non-pending order cannot be modified")
    method = _method_of(db, order["user_id"], payment_method_id)
    history = order["payment_history"]
    if len(history) != 1 or history[0]["transaction_type"] != "payment":
        raise ValueError("There should be exactly one payment for a pending order")
    old_id = history[0]["payment_method_id"]
    if old_id == payment_method_id:
        raise ValueError("The new payment method should be different from the current one")
    amount = history[0]["amount"]
    if method["source"] == "gift_card" and method["balance"] < amount:
        raise ValueError("Insufficient gift card balance to pay for the order")
    order = db["orders"].edit(order_id)
    order["payment_history"].extend(
        [
            {"transaction_type": "payment", "amount": amount, "payment_method_id": payment_method_id},
            {"transaction_type": "refund", "amount": amount, "payment_method_id": old_id},
        ]
    )
    if method["source"] == "gift_card":
        _add_balance(db, order["user_id"], payment_method_id, -amount)
    if _method_of(db, order["user_id"], old_id)["source"] == "gift_card":
        _add_balance(db, order["user_id"], old_id, amount)
    return order


def return_delivered_order_items(db: Tau2DB, order_id: str, item_ids: list[str], payment_method_id: str) -> Record:
    order = _order(db, order_id)
    if order["status"] != "delivered":
        raise ValueError("Non-delivered order cannot be returned")
    method = _method_of(db, _user(db, order["user_id"])["user_id"], payment_method_id)
    if method["source"] != "gift_card" and payment_method_id != order["payment_history"][0]["payment_method_id"]:
        raise ValueError("Payment method should be the original payment method")
    _check_counts(order, item_ids, "Some item not found")
    order = db["orders"].edit(order_id)
    order["status"], order["return_items"] = "return requested", sorted(item_ids)
    order["return_payment_method_id"] = payment_method_id
    return order


TOOLS: dict[str, ToolFn] = toolkit(
    "RetailTools",
    (
        calculate, cancel_pending_order, exchange_delivered_order_items, find_user_id_by_name_zip,
        find_user_id_by_email, get_order_details, get_product_details, get_item_details, get_user_details,
        list_all_product_types, modify_pending_order_address, modify_pending_order_items,
        modify_pending_order_payment, modify_user_address, return_delivered_order_items, transfer_to_human_agents,
    ),
)  # fmt: skip
WRITE_TOOLS = frozenset(
    {
        "cancel_pending_order", "exchange_delivered_order_items", "modify_pending_order_address",
        "modify_pending_order_items", "modify_pending_order_payment", "modify_user_address",
        "return_delivered_order_items",
    }
)  # fmt: skip
