"""Built-in training text for the generated model's BPE merges (data only, written for PolyKV).

The merges only have to make ordinary prompts cheap (English prose, Python/JSON, chat
scaffolding), so a word list weighted by rank plus a few hand-written samples is enough.
Everything here is ASCII: the trainer's pre-tokenizer regex matches llama.cpp's only on ASCII.
"""

from __future__ import annotations

# Roughly by descending frequency; the trainer weights earlier words more (split on whitespace).
ENGLISH_TEXT = """
the of and to a in is it you that he was for on are with as his they be at one have this from or
had by not word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might
story saw far sea draw left late run while press close night real life few north open seem
together next white children begin got walk example ease paper group always music those both
mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough
plain girl usual young ready above ever red list though feel talk bird soon body dog family
direct pose leave song measure door product black short numeral class wind question happen
complete ship area half rock order fire south problem piece told knew pass since top whole king
space heard best hour better true during hundred five remember step early hold west ground
interest reach fast verb sing listen six table travel less morning ten simple several vowel
toward war lay against pattern slow center love person money serve appear road map rain rule
govern pull cold notice voice unit power town fine certain fly fall lead cry dark machine note
wait plan figure star box noun field rest correct able pound done beauty drive stood contain
front teach week final gave green oh quick develop ocean warm free minute strong special mind
behind clear tail produce fact street inch multiply nothing course stay wheel full force blue
object decide surface deep moon island foot system busy test record boat common gold possible
plane instead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat
snow tire bring yes distant fill east paint language among is was are were being been has had
having does did doing done said says saying made making used using uses called calling calls
named asked asking worked working works looked looking wanted wants needed needs shows showed
shown given gives giving took taken takes went goes going came comes coming found finds thinks
thinking knows known became becomes seemed seems left based returns returned returning following
followed provides provided including included information however because without within around
another important different something nothing everything anything someone everyone probably
actually already usually really quite system systems model models data value values result
results request requests response server client user users message messages session sessions
token tokens prompt context memory cache pool pools shared prefix agent agents tool tools call
calls function functions argument arguments string number object array list dict error errors
file files path name names type types time times second seconds minute question questions answer
answers assistant summary report reports review step steps task tasks plan plans code test tests
run running output input example examples problem problems issue issues change changes update
updated version support process service services network request latency throughput batch
batches queue slot slots performance benchmark analysis research document documents text words
sentence paragraph the of and to in is that for it as was with be by on not he this are or his
from at which but public private government council city county state national local official
officials policy budget money price prices cost costs market markets company companies business
industry bank job jobs worker workers team teams member members leader leaders president
minister mayor police court law laws case cases report reported according said told added
announced expected increase increased increases decrease growth rate rates percent million
billion thousand dollars week weeks month months year years today yesterday tomorrow monday
tuesday wednesday thursday friday saturday sunday january february march april june july august
september october november december summer winter spring autumn morning evening afternoon night
weekend holiday school schools student students teacher teachers university college class lesson
history health hospital doctor doctors patient patients care medical disease drug treatment
family families child parent parents mother father brother sister son daughter wife husband
friend friends neighbor people person woman women man men girl boy baby kid kids house home room
kitchen garden door window street road car bus train plane station city town village country
world earth water fire air food bread milk coffee tea dinner lunch breakfast meal fruit apple
tomato potato vegetable meat chicken fish rice sugar salt buy bought sell sold pay paid spend
spent send sent build built bring brought keep kept decide decided create created approve
approved promise promised publish published release released receive received require required
include includes involve involved continue continued consider considered develop developed
provide provides suggest suggests explain explained describe described discuss discussed believe
believed remain remained happen happened appear appeared allow allowed reduce reduced improve
improved support start started starts finish finished close closed open opened cancel cancelled
wait waiting connect connected connection connections timeout timeouts expire expired parallel
stream streaming request requests reply replies response responses client clients server servers
several various certain possible available important different similar general special recent
recently early earlier later latest local global small large huge tiny short long quick quickly
slow slowly easy easily simple simply clear clearly real really nearly although though while
whether because since unless until after before during without walk walked walking talk talked
talking play played playing stay stayed staying plant planted planting water watered grow grew
grown eat ate eaten drink drank flower flowers tree trees grass leaf leaves seed seeds bean
beans garden gardens color colors colour light dark bright warm cold hot cool wet dry clean
dirty happy sad angry afraid tired hungry ready sure able likely unlikely the of and to in is
that for it as was with be by on not he this are or his from at which but
"""

# Short hand-written samples: prose for punctuation, code for indentation and symbols,
# and the chat/tool scaffolding the template emits.
SAMPLES = [
    """You are a helpful assistant. Answer the question using the context below.
If you do not know the answer, say so. Keep the answer short and clear.

The report describes how the team measured the system. Each agent sends a request to the
server, which reads the shared prefix from the pool and then decodes its own answer. The
results show that the cache saves time: the first token arrives sooner, and the memory used
by the sessions stays small. However, the numbers depend on the machine, so the test was run
three times and the median is given. "It works," she said, "but it's not fast enough yet."
We'll look at the data again tomorrow; they've already found two problems (see section 4.2).
""",
    '''import json
import os
from typing import Any


class Session:
    """A chat session that keeps its own history."""

    def __init__(self, name: str, max_tokens: int = 128) -> None:
        self.name = name
        self.max_tokens = max_tokens
        self.history: list[dict[str, Any]] = []

    def add(self, role: str, content: str) -> None:
        self.history.append({"role": role, "content": content})

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "history": self.history}, indent=2)


def main() -> int:
    path = os.environ.get("DATA_PATH", "data.json")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for i, item in enumerate(data["items"]):
        if item is None or not item.get("text"):
            continue
        print(f"{i}: {item['text']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
''',
    """{
  "model": "polykv-test",
  "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather like today?"}
  ],
  "max_tokens": 64,
  "temperature": 0.0,
  "stream": true
}
function update(state, action) {
  const result = { ...state, count: state.count + 1 };
  if (action.type === "reset") {
    return { count: 0 };
  }
  return result;
}
""",
    """system
You are a helpful assistant.

# Tools

<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
</tools>
user
What is the weather in Paris?
assistant
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
tool
<tool_response>
{"temperature": 18, "unit": "celsius"}
</tool_response>
assistant
It is 18 degrees in Paris.
""",
]
