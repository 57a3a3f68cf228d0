"""Every airline tool's error strings, effects and quirks (SPEC.md §4), on fresh copy-on-write databases.

Fixtures from the shipped DB: mei_hernandez_8984 holds gift_card_5309492 (amount 98), certificate_7502997 (250)
and credit cards 2140654 / 6082923. Her reservation 07S7FC is business, 2 passengers, HAT286 on 05-28 (917) and
HAT175 on 05-29 (1112), paid 4118 by credit_card_6082923; 79G8A9 is economy, 2 passengers, paid by the gift card.
HAT002 (LGA->PHX, arrives 01:30:00+1) on 2024-05-20: economy 175, 12 seats; on 2024-05-25: 0 business seats.
"""

import json

import pytest

from tests.support.tau import tool_caller, untouched_domain

USER = "mei_hernandez_8984"
GIFT, CERT, CARD = "gift_card_5309492", "certificate_7502997", "credit_card_2140654"
ONE = [{"first_name": "Mei", "last_name": "Hernandez", "dob": "1981-01-11"}]


@pytest.fixture(scope="module")
def airline(shared_data):
    yield from untouched_domain(shared_data, "airline")


@pytest.fixture
def db(airline):
    return airline.new_db()


@pytest.fixture
def call(airline, db):
    return tool_caller(airline, db)


def _book(call, payments, *, flights=None, cabin="economy", passengers=ONE, insurance="no", nonfree=0):
    return call(
        "book_reservation",
        user_id=USER,
        origin="LGA",
        destination="PHX",
        flight_type="one_way",
        cabin=cabin,
        flights=flights or [{"flight_number": "HAT002", "date": "2024-05-20"}],
        passengers=passengers,
        payment_methods=payments,
        total_baggages=nonfree,
        nonfree_baggages=nonfree,
        insurance=insurance,
    )


def _methods(db):
    return db["users"][USER]["payment_methods"]


def test_read_tools_and_the_wrong_noun_quirk(call, db):
    assert json.loads(call("get_user_details", user_id=USER))["membership"] == db["users"][USER]["membership"]
    assert call("get_user_details", user_id="nobody_1") == "Error: user not found"
    assert json.loads(call("get_reservation_details", reservation_id="07S7FC"))["cabin"] == "business"
    assert call("get_reservation_details", reservation_id="ZZZZZZ") == "Error: user not found"
    airports = json.loads(call("list_all_airports"))
    assert len(airports) == 20 and next(iter(airports)) == "SFO"
    assert airports["LGA"] == "LaGuardia" and airports["IAH"] == "Houston"


def test_search_direct_flight_merges_the_day_record_without_a_date_key(call):
    found = json.loads(call("search_direct_flight", origin="LGA", destination="PHX", date="2024-05-20"))
    assert [f["flight_number"] for f in found] == ["HAT002", "HAT114", "HAT150", "HAT201", "HAT219", "HAT245"]
    assert found[0] == {
        "flight_number": "HAT002",
        "origin": "LGA",
        "destination": "PHX",
        "scheduled_departure_time_est": "21:00:00",
        "scheduled_arrival_time_est": "01:30:00+1",
        "status": "available",
        "available_seats": {"basic_economy": 7, "economy": 12, "business": 15},
        "prices": {"basic_economy": 53, "economy": 175, "business": 344},
    }
    assert call("search_direct_flight", origin="LGA", destination="PHX", date="2024-05-10") == "[]"  # landed
    assert call("search_direct_flight", origin="LGA", destination="PHX", date="2024-06-01") == "[]"


def test_search_onestop_flight_quirks(call):
    pairs = json.loads(call("search_onestop_flight", origin="LGA", destination="SEA", date="2024-05-20"))
    assert len(pairs) == 12
    leg1, leg2 = pairs[0]
    assert (leg1["flight_number"], leg1["date"]) == ("HAT002", "2024-05-20")
    assert (leg2["flight_number"], leg2["date"]) == ("HAT045", "2024-05-21")  # overnight first leg
    # [quirk] the second leg shows the first leg's day: HAT045 on 05-20 (437 business), not 05-21 (409)
    assert leg2["prices"] == {"basic_economy": 78, "economy": 196, "business": 437}
    # [quirk] "01:30:00+1" <= "23:00:00" as strings, so an overnight leg connects to a same-evening departure
    assert leg1["scheduled_arrival_time_est"] == "01:30:00+1" and leg2["scheduled_departure_time_est"] == "23:00:00"


def test_book_reservation_prices_pays_and_uses_fixed_ids(call, db, airline):
    reservation = json.loads(
        _book(
            call, [{"payment_id": CERT, "amount": 250}, {"payment_id": CARD, "amount": 5}], insurance="yes", nonfree=1
        )
    )
    assert reservation == {
        "reservation_id": "HATHAT",
        "user_id": USER,
        "origin": "LGA",
        "destination": "PHX",
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [
            {"flight_number": "HAT002", "date": "2024-05-20", "price": 175, "origin": "LGA", "destination": "PHX"}
        ],
        "passengers": ONE,
        "payment_history": [{"payment_id": CERT, "amount": 250}, {"payment_id": CARD, "amount": 5}],
        "created_at": "2024-05-15T15:00:00",
        "total_baggages": 1,
        "nonfree_baggages": 1,
        "insurance": "yes",
    }  # 175 + 30 insurance + 50 bag = 255
    assert CERT not in _methods(db)  # a used certificate is deleted, its remainder forfeited
    assert (
        json.loads(_book(call, [{"payment_id": GIFT, "amount": 98}, {"payment_id": CARD, "amount": 77}]))[
            "reservation_id"
        ]
        == "HATHAU"
    )
    assert _methods(db)[GIFT]["amount"] == 0
    assert json.loads(_book(call, [{"payment_id": CARD, "amount": 175}]))["reservation_id"] == "HATHAV"
    assert json.loads(_book(call, [{"payment_id": CARD, "amount": 175}]))["reservation_id"] == "HATHAV"  # overwritten
    assert db["users"][USER]["reservations"][-4:] == ["HATHAT", "HATHAU", "HATHAV", "HATHAV"]
    assert len(db["reservations"]) == 2003
    seats = db["flights"]["HAT002"]["dates"]["2024-05-20"]["available_seats"]["economy"]
    assert seats == 12  # [quirk] seats never change
    assert "HATHAT" not in airline.new_db()["reservations"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"flights": [{"flight_number": "HAT999", "date": "2024-05-20"}]}, "Error: flight HAT999 not found"),
        (
            {"flights": [{"flight_number": "HAT002", "date": "2024-06-01"}]},
            "Error: flight HAT002 not found on date 2024-06-01",
        ),
        (
            {"flights": [{"flight_number": "HAT002", "date": "2024-05-01"}]},
            "Error: flight HAT002 not available on date 2024-05-01",
        ),
        (
            {"flights": [{"flight_number": "HAT002", "date": "2024-05-25"}], "cabin": "business"},
            "Error: not enough seats on flight HAT002",
        ),
        ({"cabin": "business_plus"}, "Error: 'business_plus'"),
        (
            {"payments": [{"payment_id": "credit_card_0", "amount": 175}]},
            "Error: payment method credit_card_0 not found",
        ),
        ({"payments": [{"payment_id": GIFT, "amount": 175}]}, f"Error: not enough balance in payment method {GIFT}"),
        (
            {"payments": [{"payment_id": CERT, "amount": 250}]},
            "Error: payment amount does not add up, total price is 175, but paid 250",
        ),
    ],
)
def test_book_reservation_errors_change_nothing(call, db, airline, overrides, expected):
    payments = overrides.pop("payments", [{"payment_id": CARD, "amount": 175}])
    assert _book(call, payments, **overrides) == expected
    assert db.hash() == airline.base.hash()


def test_book_reservation_error_for_unknown_user(call):
    out = call(
        "book_reservation", user_id="nobody_1", origin="", destination="", flight_type="", cabin="economy",
        flights=[], passengers=[], payment_methods=[], total_baggages=0, nonfree_baggages=0, insurance="no",
    )  # fmt: skip
    assert out == "Error: user not found"


def test_book_reservation_with_a_certificate_listed_twice_deletes_it_and_stores_nothing(call, db):
    out = _book(call, [{"payment_id": CERT, "amount": 150}, {"payment_id": CERT, "amount": 25}])
    assert out == f"Error: '{CERT}'"
    assert CERT not in _methods(db)
    assert "HATHAT" not in db["reservations"]


def test_cancel_reservation_has_no_checks_and_refunds_every_entry(call, db):
    assert call("cancel_reservation", reservation_id="ZZZZZZ") == "Error: reservation not found"
    first = json.loads(call("cancel_reservation", reservation_id="07S7FC"))
    assert first["status"] == "cancelled"
    assert [p["amount"] for p in first["payment_history"]] == [4118, -4118]
    second = json.loads(call("cancel_reservation", reservation_id="07S7FC"))
    assert [p["amount"] for p in second["payment_history"]] == [4118, -4118, -4118, 4118]
    call("cancel_reservation", reservation_id="79G8A9")
    assert _methods(db)[GIFT]["amount"] == 98  # gift cards are not restored


def test_update_reservation_baggages(call, db):
    bags = "update_reservation_baggages"
    assert call(bags, reservation_id="ZZZZZZ", total_baggages=1, nonfree_baggages=1, payment_id=GIFT) == (
        "Error: reservation not found"
    )
    assert call(bags, reservation_id="07S7FC", total_baggages=1, nonfree_baggages=0, payment_id="gift_card_1") == (
        "Error: payment method not found"
    )
    assert call(bags, reservation_id="07S7FC", total_baggages=1, nonfree_baggages=0, payment_id=CERT) == (
        "Error: certificate cannot be used to update reservation"  # checked even when the fee is 0
    )
    assert call(bags, reservation_id="07S7FC", total_baggages=5, nonfree_baggages=2, payment_id=GIFT) == (
        "Error: gift card balance is not enough"  # 100 > 98
    )
    res = json.loads(call(bags, reservation_id="07S7FC", total_baggages=4, nonfree_baggages=1, payment_id=GIFT))
    assert (res["total_baggages"], res["nonfree_baggages"]) == (4, 1)
    assert res["payment_history"][-1] == {"payment_id": GIFT, "amount": 50}
    assert _methods(db)[GIFT]["amount"] == 48
    res = json.loads(call(bags, reservation_id="07S7FC", total_baggages=0, nonfree_baggages=0, payment_id=CARD))
    assert (res["total_baggages"], res["nonfree_baggages"], len(res["payment_history"])) == (0, 0, 2)  # no refund


def test_update_reservation_flights_downgrade_reprices_but_keeps_the_cabin(call, db):
    res = json.loads(
        call(
            "update_reservation_flights",
            reservation_id="07S7FC",
            cabin="economy",
            flights=[
                {"flight_number": "HAT286", "date": "2024-05-28"},
                {"flight_number": "HAT175", "date": "2024-05-29"},
            ],
            payment_id=GIFT,
        )
    )
    assert [f["price"] for f in res["flights"]] == [105, 115]
    assert res["cabin"] == "business"  # [quirk] never updated
    assert res["payment_history"][-1] == {"payment_id": GIFT, "amount": -3618}  # (105+115)*2 - (917+1112)*2
    assert _methods(db)[GIFT]["amount"] == 3716  # a refund raises a gift card's balance


def test_update_reservation_flights_keeps_old_prices_of_kept_segments_in_the_same_cabin(call, db):
    res = json.loads(
        call(
            "update_reservation_flights",
            reservation_id="07S7FC",
            cabin="business",
            flights=[
                {"flight_number": "HAT286", "date": "2024-05-27", "note": 1},
                {"flight_number": "HAT175", "date": "2024-05-29"},
            ],
            payment_id="credit_card_6082923",
        )
    )
    assert res["flights"] == [
        {
            "flight_number": "HAT286",
            "date": "2024-05-27",
            "note": 1,
            "price": 496,
            "origin": "IAH",
            "destination": "LAS",
        },
        {"flight_number": "HAT175", "date": "2024-05-29", "price": 1112, "origin": "LAS", "destination": "IAH"},
    ]  # the kept segment keeps 1112 although 05-29 business now costs 391; extra keys are stored as given
    assert res["payment_history"][-1] == {"payment_id": "credit_card_6082923", "amount": -842}  # (496+1112-2029)*2


@pytest.mark.parametrize(
    ("reservation", "cabin", "flights", "payment", "expected"),
    [
        ("ZZZZZZ", "economy", [], CARD, "Error: reservation not found"),
        (
            "07S7FC", "business", [{"flight_number": "HAT999", "date": "2024-05-28"}], CARD,
            "Error: flight HAT999 not found",
        ),
        (
            "07S7FC", "business", [{"flight_number": "HAT286", "date": "2024-05-01"}], CARD,
            "Error: flight HAT286 not available on date 2024-05-01",
        ),
        (
            "07S7FC", "business", [{"flight_number": "HAT002", "date": "2024-05-25"}], CARD,
            "Error: not enough seats on flight HAT002",
        ),
        ("07S7FC", "business", [], "credit_card_0", "Error: payment method not found"),
        ("07S7FC", "business", [], CERT, "Error: certificate cannot be used to update reservation"),
        (
            "1AKIA8", "business",  # (312 + 240) * 2 - (196 + 169) * 2 = 374 > 98
            [{"flight_number": f, "date": d} for f, d in [("HAT070", "2024-05-22"), ("HAT297", "2024-05-23")]],
            GIFT, "Error: gift card balance is not enough",
        ),
    ],
)  # fmt: skip
def test_update_reservation_flights_errors(call, db, airline, reservation, cabin, flights, payment, expected):
    out = call(
        "update_reservation_flights", reservation_id=reservation, cabin=cabin, flights=flights, payment_id=payment
    )
    assert out == expected
    assert db.hash() == airline.base.hash()


def test_update_reservation_passengers(call):
    update = "update_reservation_passengers"
    assert call(update, reservation_id="ZZZZZZ", passengers=[]) == "Error: reservation not found"
    assert call(update, reservation_id="07S7FC", passengers=ONE) == "Error: number of passengers does not match"
    two = [{"first_name": "A", "last_name": "B", "dob": "2000-01-01", "seat": "1A"}, {"first_name": "C"}]
    assert json.loads(call(update, reservation_id="07S7FC", passengers=two))["passengers"] == two


def test_send_certificate_fills_three_slots_then_refuses(call, db):
    assert call("send_certificate", user_id="nobody_1", amount=100) == "Error: user not found"
    assert call("send_certificate", user_id=USER, amount=150) == (
        f"Certificate certificate_3221322 added to user {USER} with amount 150."
    )
    assert call("send_certificate", user_id=USER, amount=150.0) == (
        f"Certificate certificate_3221323 added to user {USER} with amount 150.0."
    )
    assert _methods(db)["certificate_3221322"] == {"source": "certificate", "amount": 150, "id": "certificate_3221322"}
    assert call("send_certificate", user_id=USER, amount=5).startswith("Certificate certificate_3221324 ")
    assert call("send_certificate", user_id=USER, amount=5) == (
        "Error: all certificate slots are already occupied for this user"
    )


def test_amounts_are_stored_as_given_so_int_and_float_hash_differently(airline):
    as_int, as_float = airline.new_db(), airline.new_db()
    airline.call(as_int, "send_certificate", {"user_id": USER, "amount": 150})
    airline.call(as_float, "send_certificate", {"user_id": USER, "amount": 150.0})
    assert as_int.hash() != as_float.hash()


@pytest.mark.parametrize(
    ("name", "module"),
    [
        ("book_reservation", "book_reservation.BookReservation"),
        ("think", "think.Think"),  # a tool both domains have, under each domain's module
        ("get_user_details", "get_user_details.GetUserDetails"),
    ],
)
def test_a_call_passing_data_names_tau_benchs_module(call, db, airline, name, module):
    assert call(name, data={}) == (
        f"Error: tau_bench.envs.airline.tools.{module}.invoke() got multiple values for keyword argument 'data'"
    )
    assert db.hash() == airline.base.hash()
