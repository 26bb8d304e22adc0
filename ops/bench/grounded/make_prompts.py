"""Writes prompts.json beside this file: 64 input-grounded prompts for benchmarking n-gram speculative decoding.

N-gram prompt lookup drafts tokens by finding the last few generated tokens in the prompt and proposing what
followed them there, so it pays off when the answer copies long spans of its prompt. Each prompt here asks the
model to reproduce a source text with a small change: rename a function, fix a typo, add comments, correct the
spelling, change the tense, swap a word, or repeat it verbatim. The model under test is SmolLM2-135M-Instruct,
so the tasks are simple and each one says plainly to print the full text again.

There are 16 source texts written for this file: 8 short Python snippets, each with one deliberate typo, and
8 everyday prose paragraphs, each with a few deliberate spelling mistakes. Each gets 4 instructions. The
entries are in ShareGPT format; the "gpt" turn is the source text itself, which stands for the expected output
length (the benchmark reads only its length). The order is instruction-major, alternating code and prose, so
consecutive entries never share a source. Deterministic: rerunning rewrites the same file.

    python ops/bench/grounded/make_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("prompts.json")

# (function name, its new name for the rename task, snippet). Each snippet has exactly one typo.
CODE = [
    (
        "cart_total",
        "basket_total",
        """
def cart_total(items, tax_rate=0.08):
    subtotal = 0.0
    for name, price, quantity in items:
        subtotal += price * quantity
    tax = subtotal * tax_rate
    retrun round(subtotal + tax, 2)


basket = [("apples", 0.5, 6), ("bread", 2.25, 1), ("milk", 1.2, 2)]
print(cart_total(basket))
""",
    ),
    (
        "celsius_to_fahrenheit",
        "c_to_f",
        """
def celsius_to_fahrenheit(celsius):
    return celsius * 9 / 5 + 32


def fahrenheit_to_celsius(fahrenheit):
    return (fahrenheit - 32) * 5 / 9


for reading in [0, 18, 25, 37, 100]:
    converted = celsius_to_fahrenheit(reading)
    pritn(f"{reading} C is {converted:.1f} F")
""",
    ),
    (
        "count_words",
        "word_frequencies",
        """
def count_words(text):
    counts = {}
    for word in text.lower().split():
        word = word.strip(".,!?;:")
        if not word:
            continue
        counts[word] = counts.get(word, 0) + 1
    return counts


sentence = "The cat sat on the mat. The mat was warm, and the cat was happy."
for word, number in sorted(count_words(sentense).items()):
    print(word, number)
""",
    ),
    (
        "add_task",
        "add_item",
        """
class TodoList:
    def __init__(self):
        self.tasks = []

    def add_task(self, title):
        self.tasks.append({"title": title, "done": False})

    def complete_task(self, title):
        for task in self.tasks:
            if task["title"] == title:
                task["done"] = Ture

    def pending(self):
        return [task["title"] for task in self.tasks if not task["done"]]

todo = TodoList()
todo.add_task("water the plants")
todo.add_task("call grandma")
todo.complete_task("call grandma")
print(todo.pending())
""",
    ),
    (
        "parse_csv_line",
        "split_fields",
        """
def parse_csv_line(line, separator=","):
    fields = []
    current = ""
    for char in line.strip():
        if char == separator:
            fields.append(current.strip())
            current = ""
        else:
            current += char
    fields.append(current.strip())
    return fields


name, age, city, job = parse_csv_line("Alice, 34, London, teacher")
print(f"{name} is {age} and works as a {job} in {citty}.")
""",
    ),
    (
        "withdraw",
        "take_out",
        """
class BankAccount:
    def __init__(self, owner, balance=0):
        self.owner = owner
        self.balance = balance

    def deposit(self, amount):
        if amount <= 0:
            raise ValueError("deposit must be positive")
        self.balance += amount

    def withdraw(self, amount):
        if amount > self.balance:
            raise ValueError("insufficient funds")
        self.balence -= amount


account = BankAccount("Maria", 100)
account.deposit(50)
account.withdraw(30)
print(account.owner, account.balance)
""",
    ),
    (
        "clap_snap",
        "number_game",
        """
def clap_snap(limit):
    words = []
    for number in range(1, limit + 1):
        if number % 28 == 0:
            words.append("ClapSnap")
        elif number % 4 == 0:
            words.append("Clap")
        elif number % 7 == 0:
            words.append("Snap")
        else:
            words.append(str(number))
    return words


for word in clap_snap(30):
    print(wrod)
""",
    ),
    (
        "roll_dice",
        "throw_dice",
        """
import random


def roll_dice(count, sides=6):
    return [random.randint(1, sides) for _ in range(count)]


def roll_summary(count, sides=6):
    rolls = roll_dice(count, sides)
    total = sum(rolls)
    return f"Rolled {rolls} for a total of {total}"


random.seed(7)
for turn in range(3):
    print(f"Turn {turn + 1}: {roll_sumary(2)}")
""",
    ),
]

# (tense it is written in, a noun that occurs in it, its replacement, paragraph). Each paragraph has 3 or 4
# misspelled words; the line breaks here are for the source file only and become single spaces.
PROSE = [
    (
        "past",
        "bread",
        "pastry",
        """
Every morning before sunrise, Mrs. Hale opened the little bakery at the end of the village street. The smell of
warm bread drifted past the church and down to the river, and the first customers were usually the farmers on
their way to the fields. She baked round loaves, sticky buns and a plum cake that people tallked about for weeks.
Children pressed their noses against the window to watch the bread come out of the oven. On Saturdays the queue
stretched all the way to the post ofice, but nobody minded waiting, becuase the bread was always worth it.
""",
    ),
    (
        "present",
        "train",
        "bus",
        """
The train leaves the city just after nine, and within minutes the grey buildings give way to green fields and
low stone walls. Anna sits by the window with a cup of tea and a book she never opens. Sheep look up as the
carriages rattle past, and a small boy across the aisle counts every bridge out loud. At each station a few
people get off and a few more get on, carying bags, flowers and umbrellas. By lunchtime the train reaches the
coast, and the sea apears suddenly between the hills, bright and enormus.
""",
    ),
    (
        "present",
        "garden",
        "yard",
        """
In spring the garden behind our house wakes up slowly. First the snowdrops push through the cold soil, then the
dafodils open along the fence like small yellow trumpets. My father spends his weekends digging new beds for
tomatos and beans, while my sister plants sunflowers in a neat row by the shed. Birds build nests in the hedge,
and a robin follows the spade, waiting for worms. By the end of April the apple tree is covered in white blosom,
and the whole garden smells sweet and fresh after the rain.
""",
    ),
    (
        "past",
        "cat",
        "kitten",
        """
Last Tuesday our cat, Pepper, did not come home for dinner. We serched the street, checked under every car and
called her name untill it was dark. My brother printed posters with her photo and we stuck them on lamp posts
all around the neighbourhod. Two days later an old man from the next road knocked on our door. He had found
Pepper asleep in his garage, curled up on a pile of blankets. The cat was hungrey and a little dusty, but
perfectly happy, and she purred all the way home.
""",
    ),
    (
        "past",
        "band",
        "orchestra",
        """
The summer festival was suposed to be the highlite of the year, but on the morning it began the rain simply
would not stop. The field turned to mud, the tents sagged, and the brass band played under a sheet of plastic.
Still, people came in wellington boots and bright raincoats, and they danced anyway. The food stalls sold hot
soup instead of ice cream, and the children held a compitition to find the deepest puddle. When the sun finally
appeared in the evening, everyone cheered as if the band had planned it.
""",
    ),
    (
        "present",
        "books",
        "novels",
        """
The town library is a quiet red-brick building next to the park. Inside, tall shelves hold thousends of books,
and the wooden floor creaks softly under every step. Students work at the long tables near the windows, while
older readers sit in armchairs with newpapers. On Thursday afternoons the librarian reads stories to a circle
of small children, who listen with their mouths open. Anyone can borrow up to ten books at a time, and the
library also lends out board games, maps and even a telescoap.
""",
    ),
    (
        "past",
        "lake",
        "pond",
        """
Early on Sunday my uncle and I drove to the lake with two rods, a box of worms and a flask of coffee. The water
was perfecly still, and thin mist hung over the reeds. We rowed the little boat to the middle of the lake and
wated for a long time without a single bite. Just as we were about to give up, my line pulled hard and I reeled
in a silver fish almost as long as my arm. We took a photo, let it go again, and rowed back to the shore
feelling like champions.
""",
    ),
    (
        "present",
        "volcano",
        "rocket",
        """
Every spring our school holds a science fair in the main hall. Students from every class set up tables with
posters, models and experimants. This year one group builds a volcano that erupts with baking soda and vinager,
and another tests which paper airplane flies the furthest. A girl from the youngest class shows how plants grow
towards the light. Parents walk from table to table asking quesions, and the judges write careful notes on
clipboards. At the end of the day, the headteacher gives prizes, but everyone agrees the best part is the volcano.
""",
    ),
]


def code_prompts(name: str, new_name: str, snippet: str) -> list[tuple[str, str]]:
    """The 4 (prompt, answer) pairs for one snippet."""
    code = snippet.strip("\n")
    assert 8 <= len(code.splitlines()) <= 20 and f"def {name}(" in code, name
    block = f"```python\n{code}\n```"
    instructions = [
        f"Rename the function {name} to {new_name} in this code and print the whole code.",
        "Fix the typo in this code and print the corrected code in full.",
        "Add a one-line comment above each function in this code and print the whole code.",
        "Print this code again exactly as it is, then say in one sentence what it does.",
    ]
    return [(f"{instruction}\n\n{block}", code) for instruction in instructions]


def prose_prompts(tense: str, word: str, new_word: str, paragraph: str) -> list[tuple[str, str]]:
    """The 4 (prompt, answer) pairs for one paragraph."""
    text = " ".join(paragraph.split())
    assert 60 <= len(text.split()) <= 110 and f" {word} " in text, word
    other_tense = "present" if tense == "past" else "past"
    instructions = [
        "Correct the spelling mistakes in this text and print the corrected text in full.",
        f"Rewrite this text in the {other_tense} tense.",
        "Repeat this text exactly, then give it a short title.",
        f"Rewrite this text replacing every occurrence of {word} with {new_word}.",
    ]
    return [(f"{instruction}\n\n{text}", text) for instruction in instructions]


def build() -> list[dict]:
    per_code = [code_prompts(*source) for source in CODE]
    per_prose = [prose_prompts(*source) for source in PROSE]
    # Instruction-major, alternating a snippet and a paragraph: consecutive entries never share a source.
    pairs = [sources[i][k] for k in range(4) for i in range(len(CODE)) for sources in (per_code, per_prose)]
    return [
        {
            "id": f"grounded-{n:02d}",
            "conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}],
        }
        for n, (prompt, answer) in enumerate(pairs)
    ]


def main() -> None:
    entries = build()
    assert len(entries) == 64
    OUT.write_text(json.dumps(entries, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {len(entries)} prompts to {OUT}")


if __name__ == "__main__":
    main()
