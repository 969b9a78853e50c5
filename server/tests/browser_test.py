"""The chat page in a real browser: headless Chromium (Debian's package,
driven by chromedriver through Selenium) loads `/`, sends a message and
must see the reply stream in; a screenshot is kept as the test artifact.

    python3 server/tests/browser_test.py [--screenshot PATH]
"""

import argparse
import os
import shutil
import sys
import time

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from harness import TARGET, Server


def find(*names):
    for n in names:
        p = shutil.which(n)
        if p:
            return p
    sys.exit(f"browser test: none of {names} is installed (scripts/setup.sh installs them)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--screenshot", default=os.path.join(TARGET, "server-test-artifacts", "chat-page.png"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.screenshot), exist_ok=True)

    opts = webdriver.ChromeOptions()
    opts.binary_location = find("chromium", "chromium-browser")
    for flag in ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1200,800"]:
        opts.add_argument(flag)
    service = Service(executable_path=find("chromedriver"))
    with Server("--max-seqs", "4") as server:
        driver = webdriver.Chrome(service=service, options=opts)
        try:
            driver.get(server.base + "/")
            wait = WebDriverWait(driver, 60)
            wait.until(lambda d: "SmolLM2" in d.find_element(By.ID, "model").text)
            driver.find_element(By.ID, "temperature").clear()
            driver.find_element(By.ID, "temperature").send_keys("0")
            box = driver.find_element(By.ID, "input")
            box.send_keys("What is the capital of France?")
            box.send_keys(Keys.ENTER)
            # Streaming: the reply bubble shows text while the Stop button is
            # still enabled, then the request ends with a finish reason.
            reply = wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant"))
            seen_partial = False
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                stop_enabled = driver.find_element(By.ID, "stop").is_enabled()
                if reply.text and stop_enabled:
                    seen_partial = True
                if not stop_enabled and reply.text:
                    break
                time.sleep(0.01)
            meta = driver.find_elements(By.CSS_SELECTOR, ".meta")[-1].text
            driver.save_screenshot(args.screenshot)
            print(f"reply: {reply.text!r}; {meta}; partial text seen while streaming: {seen_partial}")
            assert "Paris" in reply.text, reply.text
            assert meta.startswith("finish: stop"), meta
            assert seen_partial, "the reply never showed while the request ran: not streamed"
            first_reply = reply.text
            # Regenerate with greedy decoding gives the same reply.
            driver.find_element(By.ID, "regen").click()
            WebDriverWait(driver, 60).until(
                lambda d: not d.find_element(By.ID, "stop").is_enabled()
                and d.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1].text)
            again = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")
            assert len(again) == 1 and again[0].text == first_reply, [e.text for e in again]
            print(f"browser test passed; screenshot: {args.screenshot}")
        finally:
            driver.quit()


if __name__ == "__main__":
    main()
