"""Real English for the ``chat`` benchmark dataset: instructions, and passages to ask about.

Written for this benchmark (no external corpus): short tasks a chat model is
asked every day, and plain factual paragraphs of about 60-80 tokens each that
longer prompts quote before asking about them. A trained model answers these
with text of its own length and stops at its end-of-turn token, so the
benchmark measures what a chat service sees, not a fixed output length.
"""

from __future__ import annotations

INSTRUCTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "Explain how a rainbow forms.",
    "Write a short poem about the ocean.",
    "Give me three tips for sleeping better.",
    "What is the difference between weather and climate?",
    "Describe a healthy breakfast.",
    "How do I boil an egg?",
    "Why do leaves change color in autumn?",
    "Write a friendly email inviting a colleague to lunch.",
    "What are the planets of the solar system?",
    "Explain what a computer program is to a child.",
    "List five fruits that are rich in vitamin C.",
    "How does a bicycle stay upright?",
    "Suggest a name for a new coffee shop.",
    "What is photosynthesis?",
    "Give me a recipe for a simple tomato soup.",
    "Why is exercise good for the heart?",
    "Write a two-sentence story about a lost key.",
    "What causes the seasons on Earth?",
    "How should I prepare for a job interview?",
    "Explain the water cycle in simple words.",
    "What is the tallest mountain in the world?",
    "Translate 'thank you very much' into French and Spanish.",
    "Describe the smell of rain.",
)

QUESTIONS_ABOUT_TEXT: tuple[str, ...] = (
    "Summarize the text above in two sentences.",
    "List three facts from the text above.",
    "What is the main idea of the text above?",
    "Write a title for the text above.",
    "Explain the text above to a ten-year-old.",
)

PASSAGES: tuple[str, ...] = (
    "Honeybees live in colonies of tens of thousands of workers, a few hundred drones and a single queen. "
    "Workers gather nectar and pollen from flowers, and on the way they carry pollen from plant to plant, "
    "which lets many crops set fruit. Back in the hive, nectar is passed from bee to bee and slowly dried "
    "until it becomes honey, which is stored in wax cells for the winter.",
    "The first railways carried coal from mines to rivers and ports, pulled by horses on wooden rails. "
    "Steam locomotives replaced the horses in the early nineteenth century, and within a few decades iron "
    "lines linked the large cities of Europe and North America. Travel that had taken days by coach now "
    "took hours, and towns began to keep the same clock time so that timetables made sense.",
    "A volcano forms where molten rock from deep inside the Earth reaches the surface. Some volcanoes erupt "
    "quietly, with rivers of lava flowing down their sides, while others explode and throw ash high into "
    "the sky. The ash can fall far away, and over centuries the soil it leaves behind becomes very fertile, "
    "which is why farms often grow on the slopes of old volcanoes.",
    "Libraries have changed a great deal in the last fifty years. Besides books, many now lend films, music, "
    "tools and even musical instruments, and they offer free internet access to people who have none at "
    "home. Librarians teach classes on writing a letter of application or finding reliable information, "
    "and children's rooms host story hours that help young readers love books.",
    "The human heart beats about one hundred thousand times a day. It has four chambers: two atria receive "
    "blood, and two ventricles pump it out, one to the lungs to collect oxygen and the other to the rest "
    "of the body. Valves between the chambers keep the blood moving in one direction, and their closing "
    "makes the familiar sound a doctor hears through a stethoscope.",
    "Tea was first drunk in China thousands of years ago, at first as a medicine and later as an everyday "
    "drink. Traders carried it along land routes to Central Asia and by sea to Europe, where it became "
    "popular in the seventeenth century. Today black, green and oolong teas all come from the same plant; "
    "the difference lies in how long the leaves are left to oxidize after picking.",
    "Wind turbines turn the energy of moving air into electricity. The wind pushes the long blades around, "
    "the blades spin a shaft, and a generator in the housing at the top converts that motion into electric "
    "current. Turbines work best in open places with steady winds, such as hills, plains and the sea, "
    "and a large one can supply power to more than a thousand homes.",
    "Octopuses are among the most intelligent animals without a backbone. They can open jars, escape from "
    "tanks and recognize individual people. Each of their eight arms holds many nerve cells, so an arm can "
    "taste and react to what it touches almost on its own. To hide, an octopus changes the color and even "
    "the texture of its skin in a fraction of a second.",
)
