#include "data/dataset.h"

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <cstdio>
#include <random>

#include "data/jsonl.h"
#include "data/packing.h"
#include "data/text_file.h"
#include "data/token_file.h"
#include "kernels/error.h"

namespace qtrain::data {

namespace fs = std::filesystem;

namespace {

constexpr size_t kBadRecordMessagesKept = 5;

bool is_tokens(const DataOptions& options) { return options.records.format == "tokens"; }
// Formats whose long samples are documents cut into windows (see dataset.h).
bool cuts_documents_into_windows(const DataOptions& options) {
  return is_tokens(options) || options.records.format == "text";
}

std::vector<std::string> extensions_of(const DataOptions& options) {
  if (is_tokens(options)) return {".bin"};
  if (options.records.format == "text") return {".jsonl", ".txt"};
  return {".jsonl"};
}

// The files of a source: the file itself, or a directory's files of the format, in name order.
std::vector<std::string> source_files(const std::string& source, const DataOptions& options) {
  std::error_code error;
  const auto status = fs::status(source, error);
  if (!fs::exists(status)) throw Error(ErrorCode::kData, source + ": no such file or directory (data.train / data.eval)");
  if (!fs::is_directory(status)) return {source};
  const auto extensions = extensions_of(options);
  std::vector<std::string> files;
  for (auto it = fs::recursive_directory_iterator(source, error); !error && it != fs::recursive_directory_iterator();
       it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] == '.') {
      if (it->is_directory()) it.disable_recursion_pending();
      continue;
    }
    if (!it->is_regular_file()) continue;
    if (std::find(extensions.begin(), extensions.end(), it->path().extension().string()) != extensions.end()) {
      files.push_back(it->path().string());
    }
  }
  if (error) throw Error(ErrorCode::kData, source + ": cannot list the directory: " + error.message());
  if (files.empty()) {
    std::string wanted;
    for (const auto& extension : extensions) wanted += (wanted.empty() ? "*" : " or *") + extension;
    throw Error(ErrorCode::kData, source + ": the directory holds no " + wanted + " files for data.format " + options.records.format);
  }
  std::sort(files.begin(), files.end());
  return files;
}

// A preference pair: each sequence cut to its first max_seq_len tokens (TRL's keep_start) or the
// pair dropped (data.overlong); a pair whose prompt fills max_seq_len, or with a completion of no
// token, is dropped.
void add_fitted_pair(Example pair, const DataOptions& options, std::vector<Example>& out, DataStats& stats) {
  const int64_t limit = options.max_seq_len;
  const bool overlong = pair.sample_lengths[0] > limit || pair.sample_lengths[1] > limit;
  if (overlong && options.overlong == "drop") {
    ++stats.dropped;
    return;
  }
  Example fitted;
  int64_t begin = 0;
  for (const int64_t length : pair.sample_lengths) {
    const int64_t kept = std::min(length, limit);
    const auto first = static_cast<std::ptrdiff_t>(begin);
    const auto last = static_cast<std::ptrdiff_t>(begin + kept);
    fitted.input_ids.insert(fitted.input_ids.end(), pair.input_ids.begin() + first, pair.input_ids.begin() + last);
    fitted.labels.insert(fitted.labels.end(), pair.labels.begin() + first, pair.labels.begin() + last);
    const bool learned = std::any_of(pair.labels.begin() + first + 1, pair.labels.begin() + last,
                                     [](int64_t label) { return label != kIgnoreLabel; });
    if (!learned) {
      ++stats.dropped;
      return;
    }
    fitted.sample_lengths.push_back(kept);
    begin += length;
  }
  fitted.reference_log_probs = std::move(pair.reference_log_probs);
  if (overlong) ++stats.truncated;
  out.push_back(std::move(fitted));
}

// Cuts or drops a sample to fit max_seq_len (see dataset.h) and appends what remains.
void add_fitted(Example sample, bool windowed, const DataOptions& options, std::vector<Example>& out,
                DataStats& stats) {
  const int64_t limit = options.max_seq_len;
  if (windowed) {
    if (sample.size() > limit) ++stats.split_documents;
    for (int64_t begin = 0; begin < sample.size(); begin += limit) {
      const int64_t end = std::min(sample.size(), begin + limit);
      Example window;
      window.input_ids.assign(sample.input_ids.begin() + begin, sample.input_ids.begin() + end);
      window.labels.assign(sample.labels.begin() + begin, sample.labels.begin() + end);
      if (window.predicted_tokens() > 0) out.push_back(std::move(window));
    }
    return;
  }
  if (sample.sample_lengths.size() == 2) {
    add_fitted_pair(std::move(sample), options, out, stats);
    return;
  }
  if (sample.size() > limit) {
    if (options.overlong == "drop") {
      ++stats.dropped;
      return;
    }
    sample.input_ids.resize(static_cast<size_t>(limit));
    sample.labels.resize(static_cast<size_t>(limit));
    ++stats.truncated;
  }
  if (sample.predicted_tokens() == 0) {
    ++stats.dropped;
    return;
  }
  out.push_back(std::move(sample));
}

// The samples of one source (a file or a directory of shards).
std::vector<Example> read_source(const std::string& source, const DataOptions& options, const Tokenizer& tokenizer,
                                 const SampleBuilder* builder, DataStats& stats) {
  std::vector<Example> samples;
  for (const auto& file : source_files(source, options)) {
    ++stats.files;
    if (is_tokens(options)) {
      const auto tokens = read_token_file(file, tokenizer.vocab_size());
      for (auto& document : split_documents(tokens, tokenizer.bos_id().value_or(-1))) {
        ++stats.records;
        Example sample;
        sample.labels = document;
        sample.input_ids = std::move(document);
        add_fitted(std::move(sample), /*windowed=*/true, options, samples, stats);
      }
      continue;
    }
    if (fs::path(file).extension() == ".txt") {
      ++stats.records;
      add_fitted(builder->from_text(read_text_file(file, "a plain-text document")), /*windowed=*/true, options, samples, stats);
      continue;
    }
    const bool windowed = cuts_documents_into_windows(options);
    const auto skip = [&](const std::string& message) {
      if (!options.skip_bad_records) throw Error(ErrorCode::kData, message + " (data.skip_bad_records: true skips such records)");
      ++stats.bad_records;
      if (stats.bad_record_messages.size() < kBadRecordMessagesKept) stats.bad_record_messages.push_back(message);
    };
    for_each_jsonl_record(
        file,
        [&](const JsonlRecord& record) {
          ++stats.records;
          Example sample;
          try {
            sample = builder->from_record(record);
          } catch (const Error& error) {
            skip(error.what());
            return;
          }
          add_fitted(std::move(sample), windowed, options, samples, stats);
        },
        skip);
  }
  return samples;
}

// Source i contributes round(total * weight_i / sum of weights) samples, drawn without
// replacement, and again from a fresh permutation once its samples run out.
std::vector<Example> mix_sources(std::vector<std::vector<Example>> sources, const DataOptions& options,
                                 const std::vector<std::string>& names) {
  std::vector<Example> mixed;
  if (options.weights.empty()) {
    for (auto& samples : sources) std::move(samples.begin(), samples.end(), std::back_inserter(mixed));
    return mixed;
  }
  if (options.weights.size() != sources.size()) {
    throw Error(ErrorCode::kData, "data.weights has " + std::to_string(options.weights.size()) + " entries for " +
                std::to_string(sources.size()) + " data.train sources; give one weight per source");
  }
  const double weight_sum = std::accumulate(options.weights.begin(), options.weights.end(), 0.0);
  if (!(weight_sum > 0)) throw Error(ErrorCode::kData, "data.weights must not all be 0");
  size_t total = 0;
  for (const auto& samples : sources) total += samples.size();
  for (size_t index = 0; index < sources.size(); ++index) {
    const auto wanted = static_cast<size_t>(std::llround(static_cast<double>(total) * options.weights[index] / weight_sum));
    if (wanted == 0) continue;
    if (sources[index].empty()) throw Error(ErrorCode::kData, names[index] + ": no samples to draw for its data.weights share");
    std::mt19937_64 generator(options.seed * 1000003u + index);
    std::vector<size_t> order;
    size_t drawn = 0;
    while (drawn < wanted) {
      order.resize(sources[index].size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::shuffle(order.begin(), order.end(), generator);
      for (size_t position = 0; position < order.size() && drawn < wanted; ++position, ++drawn) {
        mixed.push_back(sources[index][order[position]]);
      }
    }
  }
  return mixed;
}

std::string with_commas(int64_t value) {
  std::string digits = std::to_string(value);
  for (int at = static_cast<int>(digits.size()) - 3; at > (value < 0 ? 1 : 0); at -= 3) digits.insert(at, ",");
  return digits;
}

}  // namespace

Dataset load_dataset(const std::vector<std::string>& sources, const DataOptions& options, const Tokenizer& tokenizer,
                     const std::string& model_dir) {
  if (sources.empty()) throw Error(ErrorCode::kData, "no data sources given: name a data file or a directory of shards");
  if (options.max_seq_len < 2) throw Error(ErrorCode::kData, "data.max_seq_len must be at least 2");
  if (options.overlong != "truncate" && options.overlong != "drop") {
    throw Error(ErrorCode::kData, "data.overlong must be truncate or drop, got '" + options.overlong + "'");
  }
  const PackStrategy* packing = find_pack_strategy(options.pack_strategy);
  if (packing == nullptr) {
    std::string names;
    for (const auto& strategy : pack_strategies()) names += std::string(names.empty() ? "" : ", ") + strategy.name;
    throw Error(ErrorCode::kData, "data.pack_strategy must be one of " + names + ", got '" + options.pack_strategy + "'");
  }
  if (options.pack && packing->splits_samples && !cuts_documents_into_windows(options)) {
    throw Error(ErrorCode::kData, "data.pack_strategy: " + options.pack_strategy + " cuts samples across windows, which "
                "would split a data.format " + options.records.format + " sample's prompt from its answer: use it with "
                "data.format text or tokens, or set data.pack_strategy: best_fit");
  }
  std::unique_ptr<SampleBuilder> builder;
  if (!is_tokens(options)) builder = std::make_unique<SampleBuilder>(options.records, tokenizer, model_dir);
  Dataset dataset;
  std::vector<std::vector<Example>> per_source;
  for (const auto& source : sources) {
    per_source.push_back(read_source(source, options, tokenizer, builder.get(), dataset.stats));
  }
  auto samples = mix_sources(std::move(per_source), options, sources);
  dataset.stats.samples = static_cast<int64_t>(samples.size());
  if (samples.empty()) {
    std::string names;
    for (const auto& source : sources) names += (names.empty() ? "" : ", ") + source;
    throw Error(ErrorCode::kData, names + ": no usable samples (" + std::to_string(dataset.stats.records) + " records read, " +
                std::to_string(dataset.stats.dropped) + " dropped, " + std::to_string(dataset.stats.bad_records) +
                " bad); check data.format (" + options.records.format + ") and the files");
  }
  dataset.examples = options.pack ? packing->pack(samples, options.max_seq_len) : std::move(samples);
  dataset.stats.examples = static_cast<int64_t>(dataset.examples.size());
  for (const auto& example : dataset.examples) {
    dataset.stats.tokens += example.size();
    dataset.stats.learned_tokens += example.predicted_tokens();
  }
  return dataset;
}

std::string describe(const DataStats& stats) {
  std::string text = with_commas(stats.samples) + " samples from " + with_commas(stats.records) + " records in " +
                     with_commas(stats.files) + (stats.files == 1 ? " file" : " files");
  std::vector<std::string> notes;
  if (stats.split_documents > 0) notes.push_back(with_commas(stats.split_documents) + " documents cut into windows");
  if (stats.truncated > 0) notes.push_back(with_commas(stats.truncated) + " truncated");
  if (stats.dropped > 0) notes.push_back(with_commas(stats.dropped) + " dropped");
  if (stats.bad_records > 0) notes.push_back(with_commas(stats.bad_records) + " bad records skipped");
  if (!notes.empty()) {
    text += " (";
    for (size_t i = 0; i < notes.size(); ++i) text += (i ? ", " : "") + notes[i];
    text += ")";
  }
  if (stats.examples != stats.samples) {
    char ratio[32];
    std::snprintf(ratio, sizeof ratio, "%.2f", static_cast<double>(stats.samples) / static_cast<double>(stats.examples));
    text += ", packed into " + with_commas(stats.examples) + " windows (" + ratio + " samples each)";
  }
  text += "; " + with_commas(stats.tokens) + " tokens, " + with_commas(stats.learned_tokens) + " learned";
  return text;
}

}  // namespace qtrain::data
