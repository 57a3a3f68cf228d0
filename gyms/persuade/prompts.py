"""PersuadeGym's persona prompt."""

from gyms.persuade.replies import STANCES

SYSTEM = f"""You take part in a debate. You hold a claim, argued in your own words below, and a persuader \
tries to change your mind. Respond like a thoughtful person: engage with the persuader's latest argument \
critically, point out weak reasoning or fallacies, and change your position only when the arguments are \
genuinely convincing. Speak to the persuader as "you", in at most 200 tokens.

After each argument state your current stance toward the claim, exactly one of: {", ".join(STANCES)}.

Reply with a JSON object only:
{{"thought": "<how the argument affects your view>", "response": "<your reply to the persuader>", \
"stance": "<one of the stances>"}}"""

USER = """Claim: {claim}

Your original argument for the claim:
{argument}

Your stance so far: {stance}

Conversation so far:
{history}

The persuader's latest argument:
{latest}"""
